"""A front without a tokenizer (`--skip-tokenizer-init`, as vLLM's): token ids in and out over the
model's config alone; everything that needs text is a 400 and the front serves on."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch

from inference import DynamicInferenceEngine, SamplingParams
from rollout.text import TOKENIZER_FILES, TokenizerUnavailableError, TokenOnlyCodec, has_tokenizer
from tests.rollout.http_util import MODEL, WAIT_S, engine_config, in_process_front, save_tiny_chat_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory):
    """The tiny chat model with its tokenizer files taken away."""
    directory = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-bare"))
    for entry in directory.iterdir():
        if entry.name in TOKENIZER_FILES or entry.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            entry.unlink() if entry.is_file() else shutil.rmtree(entry)
    assert not has_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def engine(bare_dir):
    torch.set_num_threads(1)
    return DynamicInferenceEngine.from_pretrained(bare_dir, engine_config())


@pytest.fixture(scope="module")
def web(engine, bare_dir):
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):  # NOTE: without the flag, as before
        with in_process_front(engine, bare_dir):
            pass
    with in_process_front(engine, bare_dir, skip_tokenizer_init=True) as front:
        with httpx.Client(base_url=front.url, timeout=WAIT_S) as c:
            yield c


def test_codec_reads_the_vocabulary_and_eos_from_the_config(bare_dir):
    codec = TokenOnlyCodec.from_config(bare_dir)
    assert codec.vocab_size == 49152 and codec.eos_token_ids == {2} and not codec.has_text
    assert codec.decode([5, 6]) == "" and codec.token_texts([5, 6]) == ["token_id:5", "token_id:6"]
    with pytest.raises(TokenizerUnavailableError, match="--skip-tokenizer-init"):
        codec.encode("hello")
    with pytest.raises(TokenizerUnavailableError):
        codec.chat_ids([{"role": "user", "content": "hi"}])


def test_token_ids_in_and_out_match_the_engine(web, engine):
    prompt = [1, 9690, 198, 2000, 3000]
    expected = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                               timeout=WAIT_S)[0].generated_token_ids
    body = {"token_ids": prompt, "model": MODEL,
            "sampling_params": {"temperature": 0, "max_tokens": 5, "ignore_eos": True, "logprobs": 1}}
    out = web.post("/inference/v1/generate", json=body)
    assert out.status_code == 200, out.text
    [choice] = out.json()["choices"]
    assert choice["token_ids"] == expected
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in expected]
    done = web.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0,
                                             "ignore_eos": True, "return_token_ids": True, "logprobs": 0})
    assert done.status_code == 200, done.text
    [comp] = done.json()["choices"]
    assert comp["text"] == "" and comp["token_ids"] == expected
    assert comp["logprobs"]["tokens"] == [f"token_id:{t}" for t in expected]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 2, "stop": ["x"]}),
    ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "stop": ["x"]}}),
    ("/tokenize", {"model": MODEL, "prompt": "hello"}),
    ("/detokenize", {"model": MODEL, "tokens": [1, 2]}),
    ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2}}),
])
def test_text_is_refused_with_a_400_and_the_front_serves_on(web, path, body):
    out = web.post(path, json=body)
    assert out.status_code == 400, out.text
    assert "skip-tokenizer-init" in out.json()["error"]["message"]
    assert web.get("/tokenizer_info").status_code == 400
    again = web.post("/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
    assert again.status_code == 200 and len(again.json()["choices"][0]["token_ids"]) == 2
