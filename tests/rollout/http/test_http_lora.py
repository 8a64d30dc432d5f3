"""LoRA adapters over HTTP, on both fronts of a `rollout serve --http` server (its own, in process,
and one over ZMQ): vLLM's load / unload routes, the OpenAI `model` field selecting an adapter,
`/v1/models` listing it with its `parent`, SGLang's routes and `lora_path`; bad adapters are
refused with vLLM's statuses and the server serves on. Expected tokens come from an in-process
engine with the same adapter (whose parity with HF + PEFT `tests/inference/lora` shows)."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoModelForCausalLM

from inference import DynamicInferenceEngine, SamplingParams
from tests.inference.lora.peft_adapters import ALL_LINEAR, save_adapter
from tests.rollout.http_util import MODEL, WAIT_S, engine_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = "The weather today is"


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    root = tmp_path_factory.mktemp("loras")
    wider = AutoModelForCausalLM.from_config(base.config.__class__(**{**base.config.to_dict(), "hidden_size": 64}))
    return {"math": save_adapter(base, root / "math", r=4, alpha=8, targets=ALL_LINEAR, seed=1, std=0.5),
            "code": save_adapter(base, root / "code", r=8, alpha=8, targets=["q_proj", "v_proj", "down_proj"],
                                 seed=2, std=0.5),
            "wrong_shapes": save_adapter(wider, root / "wide", r=4, alpha=8, targets=["q_proj"], seed=3)}


@pytest.fixture(scope="module")
def reference(model_dir, adapters):
    engine = DynamicInferenceEngine.from_pretrained(model_dir, engine_config())
    engine.load_lora("math", adapters["math"])
    engine.load_lora("code", adapters["code"])
    return engine


@pytest.fixture
def web(front_url):
    with httpx.Client(base_url=front_url, timeout=WAIT_S) as c:
        yield c
        for name in ("math", "code"):
            c.post("/v1/unload_lora_adapter", json={"lora_name": name})


def greedy(engine, prompt, lora=None):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, lora_name=lora)
    return engine.generate([prompt], params, timeout=WAIT_S)[0].generated_token_ids


def test_vllm_routes_load_select_by_model_and_unload(web, oai, codec, reference, adapters):
    r = web.post("/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": str(adapters["math"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'math' added successfully."
    again = web.post("/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": str(adapters["math"])})
    assert again.status_code == 400 and "already been loaded" in again.text
    cards = {m.id: m for m in oai.models.list().data}
    assert list(cards) == [MODEL, "math"] and cards["math"].parent == MODEL
    assert cards["math"].root == str(adapters["math"])
    prompt = codec.encode(PROMPT)
    outs = {model: oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].token_ids
            for model in (MODEL, "math")}
    assert outs == {MODEL: greedy(reference, prompt), "math": greedy(reference, prompt, "math")}
    assert outs[MODEL] != outs["math"]  # the adapter changes the tokens, so a mix-up would show
    chat = oai.chat.completions.create(model="math", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0)
    assert chat.model == "math" and chat.choices[0].message.content is not None
    r = web.post("/v1/unload_lora_adapter", json={"lora_name": "math"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'math' removed successfully."
    assert [m.id for m in oai.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="math", prompt=PROMPT, max_tokens=2)
    assert web.post("/v1/unload_lora_adapter", json={"lora_name": "math"}).status_code == 404


def test_bad_adapters_are_refused_and_the_server_serves_on(web, oai, codec, reference, adapters, tmp_path):
    for path, words in ((tmp_path / "nothing", "does not exist"), (adapters["wrong_shapes"], "A must be")):
        r = web.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert web.post("/v1/load_lora_adapter", json={"lora_name": "bad"}).status_code == 400  # no lora_path
    assert [m.id for m in oai.models.list().data] == [MODEL]
    out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.choices[0].token_ids == greedy(reference, codec.encode(PROMPT))


def test_sglang_routes_and_lora_path(web, codec, reference, adapters):
    r = web.post("/load_lora_adapter", json={"lora_name": "code", "lora_path": str(adapters["code"])})
    assert r.status_code == 200
    assert r.json() == {"success": True, "error_message": "", "loaded_adapters": {"code": str(adapters["code"])}}
    prompt = codec.encode(PROMPT)
    sampling = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    for lora in ("code", str(adapters["code"])):  # by name or by the path it was loaded from
        out = web.post("/generate", json={"input_ids": prompt, "sampling_params": sampling, "lora_path": lora}).json()
        assert out["output_ids"] == greedy(reference, prompt, "code")
    batch = web.post("/generate", json={"input_ids": [prompt, prompt], "sampling_params": sampling,
                                        "lora_path": [None, "code"]}).json()
    assert [o["output_ids"] for o in batch] == [greedy(reference, prompt), greedy(reference, prompt, "code")]
    bad = web.post("/generate", json={"input_ids": prompt, "lora_path": "nope"})
    assert bad.status_code == 400 and "lora_path" in bad.text
    missing = web.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/dir"})
    assert missing.status_code == 400 and missing.json()["success"] is False
    r = web.post("/unload_lora_adapter", json={"lora_name": "code"})
    assert r.json() == {"success": True, "error_message": "", "loaded_adapters": {}}


def test_a_config_rank_the_tensors_do_not_have_is_refused_naming_both(web, oai, model_dir, tmp_path):
    """PEFT builds each module at its config's rank (`rank_pattern` where a key names it, else `r`):
    tensors of another rank are refused with 400 naming both numbers; a valid `rank_pattern`
    adapter loads and serves."""
    import json

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    wrong = save_adapter(base, tmp_path / "wrong", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=4)
    config = json.loads((wrong / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    r = web.post("/v1/load_lora_adapter", json={"lora_name": "wrong", "lora_path": str(wrong)})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "rank 4 in its tensors but rank 8 in its adapter_config.json" in message, r.text
    patterned = save_adapter(base, tmp_path / "patterned", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=4,
                             rank_pattern={"v_proj": 2}, alpha_pattern={"q_proj": 16})
    r = web.post("/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": str(patterned)})
    assert r.status_code == 200, r.text
    out = oai.completions.create(model="math", prompt=PROMPT, max_tokens=2)
    assert len(out.choices[0].token_ids) == 2


def test_loads_of_one_name_sent_together_load_it_once(front_url, adapters):
    """vLLM's answer to a second load of a loaded name is 400; sent at once, one load wins and the
    others get that 400 (they all used to succeed, loading versions 1, 2, 3...)."""
    import concurrent.futures

    def load(_: int) -> httpx.Response:
        with httpx.Client(base_url=front_url, timeout=WAIT_S) as c:
            return c.post("/v1/load_lora_adapter", json={"lora_name": "math", "lora_path": str(adapters["math"])})
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = sorted(r.status_code for r in pool.map(load, range(4)))
        assert codes == [200, 400, 400, 400]
    finally:
        with httpx.Client(base_url=front_url, timeout=WAIT_S) as c:
            c.post("/v1/unload_lora_adapter", json={"lora_name": "math"})
