"""vLLM's RL routes on the HTTP front (`rollout.http.vllm.vllm_routes`): control, sleep, token in / token
out, with vLLM's paths, query parameters, bodies and answers; greedy ids checked against the engine
itself. A front on an engine in this process (`serve_front`), real HTTP."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from inference import DynamicInferenceEngine, SamplingParams
from rollout.http.core.generation import version_spans
from tests.rollout.http_util import (
    MAX_LEN,
    MODEL,
    WAIT_S,
    engine_config,
    in_flight,
    in_process_front,
    save_tiny_chat_model,
    wait_running,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def engine(model_dir):
    torch.set_num_threads(1)
    return DynamicInferenceEngine.from_pretrained(model_dir, engine_config())


@pytest.fixture(scope="module")
def front_url(engine, model_dir):
    with in_process_front(engine, model_dir) as front:
        yield front.url


@pytest.fixture
def web(front_url):
    with httpx.Client(base_url=front_url, timeout=WAIT_S) as c:
        yield c
        c.post("/resume")
        c.post("/wake_up")


def greedy(engine, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return engine.generate([prompt], params, timeout=WAIT_S)[0].generated_token_ids


# ---- token in, token out -------------------------------------------------------------------------


def test_generate_answers_vllms_shape_with_versions(web, engine):
    prompt = [1, 9690, 198, 2000, 3000]
    body = {"token_ids": prompt, "model": MODEL, "request_id": "req-1",
            "sampling_params": {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 2,
                                "prompt_logprobs": 1}}
    out = web.post("/inference/v1/generate", json=body)
    assert out.status_code == 200, out.text
    reply = out.json()
    assert reply["request_id"] == "req-1"
    [choice] = reply["choices"]
    assert choice["token_ids"] == greedy(engine, prompt, 6) and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    version = int(web.get("/weight_info").json()["weight_version"])
    assert choice["weight_versions"] == [{"version": version, "start": 0, "end": 6}]
    prompt_lps = reply["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    assert str(prompt[1]) in prompt_lps[1]


def test_generate_streams_the_same_ids(web, engine):
    prompt = [1, 2000, 3000]
    body = {"token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 5, "ignore_eos": True},
            "stream": True}
    with web.stream("POST", "/inference/v1/generate", json=body) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == greedy(engine, prompt, 5) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    spans = [s for c in chunks for s in c["choices"][0]["weight_versions"]]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == 5


@pytest.mark.parametrize("kind", [0, 2])
def test_generate_streams_by_output_kind(web, engine, kind):
    """vLLM's RequestOutputKind: cumulative chunks hold every id so far; final-only is one chunk."""
    prompt = [1, 2000, 3000]
    body = {"token_ids": prompt, "stream": True,
            "sampling_params": {"temperature": 0, "max_tokens": 5, "ignore_eos": True, "output_kind": kind}}
    with web.stream("POST", "/inference/v1/generate", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    ids = [c["choices"][0]["token_ids"] for c in chunks]
    want = greedy(engine, prompt, 5)
    assert ids[-1] == want and all(want[:len(i)] == i for i in ids)
    assert len(chunks) == 1 if kind == 2 else len(chunks) > 1


def test_generate_refuses_bad_input_with_vllms_400(web):
    def refused(body: dict, param: str) -> None:
        out = web.post("/inference/v1/generate", json=body)
        assert out.status_code == 400, out.text
        assert out.json()["error"]["param"] == param, out.json()
    refused({"token_ids": []}, "token_ids")
    refused({"token_ids": [1, 10**7]}, "token_ids")
    refused({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens")
    refused({"token_ids": [1], "sampling_params": {"best_of": 2}}, "sampling_params.best_of")
    refused({"token_ids": [1], "sampling_params": {"structured_outputs": {"regex": "a("}}}, "structured_outputs")
    assert web.post("/inference/v1/generate", json={"token_ids": [1], "model": "other"}).status_code == 404
    ok = web.post("/inference/v1/generate", json={"token_ids": [1, 5], "sampling_params": {
        "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "stop"


def test_version_spans_cover_runs():
    assert version_spans([]) == []
    assert version_spans([3, 3, 4, 4, 4], start=2) == [{"version": 3, "start": 2, "end": 4},
                                                       {"version": 4, "start": 4, "end": 7}]


# ---- control -------------------------------------------------------------------------------------


def test_pause_keep_then_resume_finishes_in_flight_work(web, front_url):
    """`/pause?mode=keep` freezes a request mid-generation; `/resume` lets it finish (SkyRL's and
    TRL's weight-sync cycle)."""
    pending = in_flight(front_url, 300)
    wait_running(web)
    assert web.post("/pause", params={"mode": "keep"}).json() == {"status": "paused", "mode": "keep",
                                                                   "clear_cache": "true"}
    assert web.get("/is_paused").json() == {"is_paused": True}
    assert web.post("/resume").json() == {"status": "resumed"}
    assert web.get("/is_paused").json() == {"is_paused": False}
    response = pending.result(WAIT_S)
    reply = response.json()
    assert response.status_code == 200 and reply["choices"][0]["finish_reason"] == "length"
    assert len(reply["choices"][0]["token_ids"]) == 300


def test_pause_abort_ends_in_flight_with_abort(web, front_url):
    pending = in_flight(front_url, 400)
    wait_running(web)
    assert web.post("/pause").json()["mode"] == "abort"  # vLLM's default mode
    assert pending.result(WAIT_S).json()["choices"][0]["finish_reason"] == "abort"
    web.post("/resume")


def test_bad_control_input_is_a_400_and_the_server_serves_on(web):
    assert web.post("/pause", params={"mode": "nap"}).status_code == 400
    assert web.post("/sleep", params={"level": 3}).status_code == 400
    assert web.post("/sleep", params={"tags": "gpu"}).status_code == 400
    assert web.get("/server_info", params={"config_format": "yaml"}).status_code == 400
    assert web.post("/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
                    ).status_code == 200


def test_abort_requests_by_id_and_all(web, front_url):
    pending = {rid: in_flight(front_url, 400, request_id=rid) for rid in ("a", "b")}
    wait_running(web, 2)
    assert web.post("/abort_requests", json={"request_ids": ["a"]}).json() == {"status": "aborted", "aborted": 1}
    assert pending["a"].result(WAIT_S).json()["choices"][0]["finish_reason"] == "abort"
    assert web.post("/inference/v1/abort_requests", json={"request_ids": ["b"]}).status_code == 200
    assert pending["b"].result(WAIT_S).json()["choices"][0]["finish_reason"] == "abort"
    assert web.post("/abort_requests", json={}).json() == {"status": "aborted", "aborted": 0}


def test_sleep_and_wake_up_by_tag(web, engine):
    """vLLM's RL cycle: sleep, wake the weights (to load new ones), then the KV cache; each call
    once per part, so a repeated one changes nothing."""
    prompt = [1, 2000, 3000]
    want = greedy(engine, prompt, 4)
    assert web.get("/is_sleeping").json() == {"is_sleeping": False}
    assert web.post("/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1, "tags": None}
    assert web.get("/is_sleeping").json() == {"is_sleeping": True}
    assert engine.core.asleep == {"kv_cache", "weights"}
    assert web.post("/sleep", params={"level": 1}).status_code == 200  # asleep already: nothing changes
    assert web.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert engine.core.asleep == {"kv_cache"} and web.get("/is_sleeping").json() == {"is_sleeping": True}
    assert web.post("/wake_up", params={"tags": "weights"}).status_code == 200  # awake already
    assert web.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert web.get("/is_sleeping").json() == {"is_sleeping": False}
    assert web.post("/wake_up").status_code == 200  # awake already
    body = {"token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 4, "ignore_eos": True}}
    assert web.post("/inference/v1/generate", json=body).json()["choices"][0]["token_ids"] == want


def test_sleep_level_two_drops_the_weights_until_an_update(web, engine):
    """Level 2 frees the weights' bytes with no copy (this model's tied embedding and head too);
    after an update, greedy is what it was."""
    body = {"token_ids": [1, 2000, 3000], "sampling_params": {"temperature": 0, "max_tokens": 4, "ignore_eos": True}}
    want = web.post("/inference/v1/generate", json=body).json()["choices"][0]["token_ids"]
    weights = {n: t.detach().clone() for n, t in engine.model.named_tensors().items()}
    assert web.post("/sleep", params={"level": 2}).status_code == 200
    assert engine.core.weights.offloaded_bytes() == 0 and engine.core.weights.discarded_bytes() > 0
    assert web.post("/wake_up").status_code == 200
    out = web.post("/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
    assert out.status_code == 503 and "discarded" in out.json()["error"]["message"]
    engine.update_weights(weights)  # the trainer's update (the weight routes, in their own tests)
    assert web.post("/inference/v1/generate", json=body).json()["choices"][0]["token_ids"] == want


def test_reset_prefix_cache_and_server_info(web):
    assert web.post("/reset_prefix_cache").json() == {"success": True}
    assert web.get("/get_world_size").json() == {"world_size": 1}
    info = web.get("/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["model_config"]["max_model_len"] == MAX_LEN and info["model_config"]["dtype"] == "torch.float32"
    assert info["model_config"]["served_model_name"] == [MODEL]
    assert info["lora_config"] == {"max_loras": 4, "max_lora_rank": 64, "loaded": []}  # the engine's defaults
    assert isinstance(web.get("/server_info").json()["vllm_config"], str)


def test_metrics_in_prometheus_text_with_vllms_names(web):
    """A scrape, a generation of 5 tokens, another scrape: the counters moved by exactly what was done."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict[str, float]:
        r = web.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        out = {}
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                if sample.labels.get("model_name") == MODEL and sample.labels.get("part") in (None, "weights"):
                    out[sample.name] = sample.value
        return out

    before = scrape()
    prompt = [1, 2000, 3000, 4000]
    web.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {
        "temperature": 0, "max_tokens": 5, "ignore_eos": True}})
    after = scrape()
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == len(prompt)
    assert after["vllm:prefix_cache_queries_total"] >= after["vllm:prefix_cache_hits_total"]
    assert after["vllm:num_requests_running"] == 0 and 0 <= after["vllm:kv_cache_usage_perc"] <= 1
    assert after["rollout:policy_version"] == float(web.get("/weight_info").json()["weight_version"])
    assert after["rollout:asleep"] == 0 and after["rollout:prefix_cache_hits_cross_version_total"] == 0


def test_update_weight_version_keeps_in_flight_work_and_splits_its_spans(web, front_url):
    """vLLM's and SGLang's `/update_weight_version`: nothing aborted (unless asked); the request in
    flight goes on and its tokens after the change carry the new version."""
    old = int(web.get("/weight_info").json()["weight_version"])
    pending = in_flight(front_url, 300)
    wait_running(web)
    new = old + 5
    out = web.post("/update_weight_version", json={"new_version": f"v{new}"})
    assert out.status_code == 200 and out.json()["success"] is True and "kept" in out.json()["message"]
    choice = pending.result(WAIT_S).json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 300
    spans = choice["weight_versions"]
    assert [s["version"] for s in spans] == [old, new] and spans[0]["end"] == spans[1]["start"]
    assert spans[0]["start"] == 0 and spans[1]["end"] == 300
    assert web.get("/weight_info").json() == {"weight_version": str(new)}
    assert web.post("/update_weight_version", json={"new_version": str(new)}).status_code == 400  # not newer
    assert web.post("/update_weight_version", json={"new_version": "latest"}).status_code == 400


def test_reset_with_running_requests_retracts_them_and_keeps_a_callers_pause(web, front_url):
    """`reset_running_requests`: the running give their blocks back (recomputed) and the cache
    resets; a pause the caller had made stays in place."""
    pending = in_flight(front_url, 300)
    wait_running(web)
    assert web.post("/reset_prefix_cache").json() == {"success": False}  # blocks held: vLLM's answer
    web.post("/pause", params={"mode": "keep"})
    assert web.post("/reset_prefix_cache", params={"reset_running_requests": True}).json() == {"success": True}
    assert web.get("/is_paused").json() == {"is_paused": True}
    web.post("/resume")
    choice = pending.result(WAIT_S).json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 300


def test_finish_session_forgets_a_sessions_turns(web):
    """SkyRL's `/finish_session?session_id=` at a trajectory's end: the session's turns are dropped
    (the next turn under that id starts over); an unknown id is no error; a missing one is a 400."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "session_id": "traj-1"}
    assert web.post("/v1/chat/completions", json=chat).status_code == 200
    assert web.post("/finish_session", params={"session_id": "traj-1"}).json() == {
        "status": "ok", "session_id": "traj-1", "released": True}
    assert web.post("/finish_session", params={"session_id": "traj-1"}).json()["released"] is False
    assert web.post("/finish_session").status_code == 400
