"""What SGLang's `/generate` answers about where each token came from, on a tiny MoE model served
token-only (`--skip-tokenizer-init`): the routed experts in SGLang's encoding (decoded as AReaL and
slime decode them) equal to the in-process engine's, also after preemption and recompute; prompt
log-probs from `logprob_start_len` equal to the engine's; `extra_key` salting the prefix cache."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from tests.inference.models.moe.tiny import tiny_moe
from tests.rollout.http_util import WAIT_S

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = [[5, 9, 11, 3, 40, 41], [7, 8, 100, 101, 102, 103, 104, 105, 106]]
ROOMY = InferenceConfig(block_size=4, num_blocks=256, max_requests=8, max_batch_tokens=64, max_sequence_length=128)
TIGHT = InferenceConfig(block_size=4, num_blocks=18, max_requests=8, max_batch_tokens=64, max_sequence_length=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-moe")
    tiny_moe("qwen3_moe").save_pretrained(directory)
    return directory


def serve(model_dir, config):
    from rollout.client.in_process import InProcessClient
    from rollout.http.launch import serve_front

    torch.set_num_threads(1)
    engine = DynamicInferenceEngine.from_pretrained(model_dir, config)
    client = InProcessClient(engine, timeout=WAIT_S)
    front = serve_front(client, model_dir, served_model_name="moe", max_model_len=128, timeout=WAIT_S,
                        on_stop=client.shutdown, skip_tokenizer_init=True)
    return engine, front


@pytest.fixture(scope="module")
def roomy(model_dir):
    engine, front = serve(model_dir, ROOMY)
    yield engine, httpx.Client(base_url=front.url, timeout=WAIT_S)
    front.stop()


def in_process(engine, prompts, params):
    return [engine.generate([p], [params], timeout=WAIT_S)[0] for p in prompts]


def areal_decode(meta: dict) -> np.ndarray:
    """areal/engine/sglang_remote.py (v1.0.4) `parse_generation_response`: base64 int32 rows of
    prompt + completion - 1 positions."""
    rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    return np.frombuffer(base64.b64decode(meta["routed_experts"].encode()), dtype=np.int32).reshape(rows, -1)


def test_routed_experts_decode_as_areal_and_slime_read_them(roomy):
    engine, web = roomy
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, return_routed_experts=True)
    want = in_process(engine, PROMPTS, params)
    out = web.post("/generate", json={"input_ids": PROMPTS, "return_routed_experts": True, "return_logprob": True,
                                      "image_data": None, "sampling_params": {
                                          "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}).json()
    for got, ref in zip(out, want):
        assert got["output_ids"] == ref.generated_token_ids
        meta = got["meta_info"]
        routes = ref.routed_experts  # [positions fed, moe layers, k]
        np.testing.assert_array_equal(areal_decode(meta), routes.reshape(routes.shape[0], -1))
        # slime/utils/types.py:352-375 (THUDM/slime@624b824a8): rows = tokens - 1 - routed_experts_start_len
        assert meta["routed_experts_start_len"] == 0
        assert areal_decode(meta).size == (len(got["output_ids"]) + len(ref.prompt_token_ids) - 1) * 2 * 2
    plain = web.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}).json()
    assert "routed_experts" not in plain["meta_info"]


def test_routes_survive_preemption_and_recompute(model_dir, roomy):
    """18 blocks of 4 tokens for 8 requests of up to 6 + 24 tokens: the engine preempts and
    recomputes; every request's routes still equal the unpreempted engine's."""
    roomy_engine, _ = roomy
    prompts = [[3 + i, 9, 11, 3, 40 + i, 41] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, return_routed_experts=True)
    want = in_process(roomy_engine, prompts, params)
    engine, front = serve(model_dir, TIGHT)
    try:
        with httpx.Client(base_url=front.url, timeout=WAIT_S) as web:
            out = web.post("/generate", json={"input_ids": prompts, "return_routed_experts": True, "sampling_params": {
                "temperature": 0, "max_new_tokens": 24, "ignore_eos": True}}).json()
        assert engine.stats()["preemptions"] > 0
    finally:
        front.stop()
    for got, ref in zip(out, want):
        assert got["output_ids"] == ref.generated_token_ids
        np.testing.assert_array_equal(areal_decode(got["meta_info"]),
                                      ref.routed_experts.reshape(ref.routed_experts.shape[0], -1))
        version = engine.policy_version  # recomputed tokens keep the version that sampled them
        assert got["meta_info"]["weight_versions"] == [{"version": version, "start": 0, "end": 24}]


def test_prompt_logprobs_from_logprob_start_len(roomy):
    engine, web = roomy
    prompt = PROMPTS[1]
    ref = engine.generate([prompt], [SamplingParams(max_tokens=1, prompt_logprobs=2)], timeout=WAIT_S)[0]
    for start in (0, 3):
        meta = web.post("/generate", json={"input_ids": prompt, "return_logprob": True, "logprob_start_len": start,
                                           "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 1}}
                        ).json()["meta_info"]
        rows = meta["input_token_logprobs"]
        assert [r[1] for r in rows] == prompt[start:]
        for p, (lp, token, _) in zip(range(start, len(prompt)), rows):
            assert (lp is None) if p == 0 else lp == pytest.approx(ref.prompt_logprobs[p][token], abs=1e-6)
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(prompt) - start and all(len(t) == 2 for t in tops if t is not None)
    bad = web.post("/generate", json={"input_ids": prompt, "return_logprob": True, "logprob_start_len": len(prompt),
                                      "sampling_params": {"max_new_tokens": 1}})
    assert bad.status_code == 400 and "logprob_start_len" in bad.text


def test_extra_key_salts_the_prefix_cache(roomy):
    engine, web = roomy
    prompt = list(range(50, 50 + 16))

    def cached(key):
        before = engine.stats()["prefix_cached_tokens"]
        meta = web.post("/generate", json={"input_ids": prompt, "extra_key": key,
                                           "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
        took = engine.stats()["prefix_cached_tokens"] - before
        assert meta["cached_tokens"] == took  # SGLang's per-request count, which slime reads
        return took

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same key reuses its blocks
    assert cached("tenant-b") == 0  # another key never shares them


def _sse(lines):
    import json

    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


ROUTES = {
    "sglang": ("/generate", lambda p, n: {"input_ids": p, "stream": True, "return_routed_experts": True,
                                          "sampling_params": {"temperature": 0, "max_new_tokens": n,
                                                              "ignore_eos": True}}),
    "openai": ("/v1/completions", lambda p, n: {"model": "moe", "prompt": p, "stream": True, "max_tokens": n,
                                                "temperature": 0, "ignore_eos": True, "return_token_ids": True}),
    "vllm": ("/inference/v1/generate", lambda p, n: {"token_ids": p, "stream": True, "sampling_params": {
        "temperature": 0, "max_tokens": n, "ignore_eos": True}}),
}


def _spans_and_ids(route: str, chunk: dict, ids: list, spans: list) -> None:
    """Fold one chunk into the stream's ids and version spans (SGLang's chunks are cumulative)."""
    if route == "sglang":
        ids[:] = chunk["output_ids"]
        spans[:] = chunk["meta_info"]["weight_versions"]
        return
    choice = chunk["choices"][0]
    ids.extend(choice.get("token_ids") or [])
    for span in choice.get("weight_versions") or []:
        if spans and spans[-1]["version"] == span["version"] and spans[-1]["end"] == span["start"]:
            spans[-1]["end"] = span["end"]
        else:
            spans.append(dict(span))


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_streamed_spans_split_at_a_keep_update(roomy, route):
    """Every chunk carries its tokens' versions: a stream paused (`keep`) after its first tokens,
    moved to a new version, resumed, reads back `[v: 0..k], [v + 1: k..n]` with k at or past what
    it had received, the ids equal greedy in process, and (SGLang) its final chunk the routes."""
    engine, web = roomy
    prompt, n = PROMPTS[0], 120
    want = engine.generate([prompt], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                     return_routed_experts=True)], timeout=WAIT_S)[0]
    old = int(web.get("/weight_info").json()["weight_version"])
    path, body = ROUTES[route]
    ids, spans, before, last = [], [], None, None
    with httpx.Client(base_url=str(web.base_url), timeout=WAIT_S) as control:
        with web.stream("POST", path, json=body(prompt, n)) as r:
            assert r.status_code == 200
            for chunk in _sse(r.iter_lines()):
                _spans_and_ids(route, chunk, ids, spans)
                last = chunk
                if before is None and ids:
                    before = len(ids)
                    assert control.post("/pause", params={"mode": "keep"}).status_code == 200
                    assert control.post("/update_weight_version", json={"new_version": str(old + 1)}
                                        ).status_code == 200
                    assert control.post("/resume").status_code == 200
    assert ids == want.generated_token_ids
    assert [s["version"] for s in spans] == [old, old + 1], spans
    assert spans[0]["start"] == 0 and before <= spans[0]["end"] == spans[1]["start"] < n and spans[1]["end"] == n
    if route == "sglang":
        np.testing.assert_array_equal(areal_decode(last["meta_info"]),
                                      want.routed_experts.reshape(want.routed_experts.shape[0], -1))
