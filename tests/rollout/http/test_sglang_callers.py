"""SGLang's RL routes as its RL callers call them, replayed against a real `rollout serve --http`:
each test cites the caller's file and lines at a pinned commit and reads every field that caller
reads. slime at THUDM/slime 624b824a8 (its code is read from its repository; PyPI's `slime` is
another project). AReaL's own client code runs in `bench/clients/areal_client_check.py`."""

from __future__ import annotations

import pickle

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.rollout.http_util import WAIT_S, greedy_ids, http_server_process, old_and_new_models
from weight_sync.tensor_payload import TensorPayload

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SLIME = "THUDM/slime@624b824a8"
PROMPTS = [[1, 400, 500, 600], [50, 60, 70]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return old_and_new_models(tmp_path_factory.mktemp("sglang-callers"))


@pytest.fixture(scope="module")
def server(dirs):
    with http_server_process(dirs[0]) as proc:
        yield proc


@pytest.fixture
def web(server):
    with httpx.Client(base_url=server.http_url, timeout=WAIT_S) as c:
        yield c


@pytest.fixture(scope="module")
def expected(dirs):
    return {key: greedy_ids(d, PROMPTS) for key, d in zip(("old", "new"), dirs)}


def greedy(web: httpx.Client) -> list[list[int]]:
    outs = web.post("/generate", json={"input_ids": PROMPTS, "sampling_params": {
        "temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}).json()
    return [o["output_ids"] for o in outs]


def test_slime_discovers_an_external_engine_from_server_info(web):
    """slime/backends/sglang_utils/external.py:74-83 (GET /server_info, then /get_server_info),
    :28-42 and :95-107 (the parallel sizes, GPU count, worker type it reads)."""
    for path in ("/server_info", "/get_server_info"):
        info = web.get(path).json()
        pp = int(info.get("pp_size") or info.get("pipeline_parallel_size") or 1)
        tp = int(info.get("tp_size") or info.get("tensor_parallel_size") or 1)
        assert (tp, pp) == (1, 1)
        assert int(info.get("num_gpus") or info.get("num_gpus_per_engine") or tp * pp) == 1
        assert int(info.get("ep_size") or 1) == 1 and int(info.get("moe_dp_size") or 1) == 1
        assert not info.get("encoder_only") and info.get("disaggregation_mode") not in ("prefill", "decode")
        assert info.get("disaggregation_bootstrap_port") is None
    assert "vllm_config" in web.get("/server_info").json()  # one handler answers vLLM's readers too


def test_slime_memory_calls_read_json_back(web, expected):
    """slime/backends/sglang_utils/sglang_engine.py:201-221 (`_make_request` posts JSON, raises on
    an error status, returns `response.json()`), :328-339 (release after a flush, resume by tags:
    weights, then kv_cache, as its colocated loop does), :270-288 (flush_cache by GET, 200 once idle)."""
    assert web.get("/flush_cache").status_code == 200
    released = web.post("/release_memory_occupation", json={})
    assert released.status_code == 200 and released.json() is None
    for tags in (["weights"], ["kv_cache"]):
        resumed = web.post("/resume_memory_occupation", json={"tags": tags})
        assert resumed.status_code == 200 and resumed.json() is None
    assert web.post("/release_memory_occupation", json={}).status_code == 200
    assert web.post("/resume_memory_occupation", json={"tags": None}).json() is None  # slime sends tags=None
    assert greedy(web) == expected["old"]


def test_update_weights_from_tensor_takes_our_handle_and_refuses_pickle(web, dirs, expected):
    """slime/backends/sglang_utils/sglang_engine.py:245-268 (`serialized_named_tensors`, `load_format`,
    `flush_cache`, `weight_version`), :320-326 (`/get_weight_version`'s `weight_version`). slime sends
    SGLang's pickled `MultiprocessingSerializer` output: refused with a 400 naming the safe handle,
    never unpickled, and the old weights keep serving."""
    version = int(web.get("/get_weight_version").json()["weight_version"])
    new = sorted(load_file(dirs[1] / "model.safetensors").items())
    pickled = __import__("base64").b64encode(pickle.dumps({"flattened_tensor": torch.ones(4)})).decode()
    refused = web.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [pickled], "load_format": "flattened_bucket", "flush_cache": False})
    assert refused.status_code == 400 and refused.json()["success"] is False
    assert "pickled" in refused.json()["message"] and "encode_tensor_payload" in refused.json()["message"]
    assert greedy(web) == expected["old"]
    with TensorPayload(new) as payload:
        out = web.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [payload.text], "load_format": "flattened_bucket", "flush_cache": False,
            "weight_version": f"v{version + 3}"})
    assert out.status_code == 200 and out.json()["success"] is True, out.text
    assert web.get("/get_weight_version").json()["weight_version"] == str(version + 3)
    assert greedy(web) == expected["new"]
    with TensorPayload(sorted(load_file(dirs[0] / "model.safetensors").items())) as payload:
        assert web.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload.text]}
                        ).json()["success"] is True
    assert greedy(web) == expected["old"]
    assert web.post("/update_weights_from_tensor", json={"serialized_named_tensors": []}).status_code == 400


def test_loads_report_what_is_running(server, web):
    """SGLang's `/v1/loads` (its gateway's load poll): running, waiting, token usage."""
    from tests.rollout.http_util import in_flight, wait_running

    idle = web.get("/v1/loads").json()["loads"]
    assert len(idle) == 1 and idle[0]["num_running_reqs"] == 0 and idle[0]["max_total_num_tokens"] > 0
    pending = in_flight(server.http_url, 200)
    wait_running(web)
    busy = web.get("/v1/loads").json()["loads"][0]
    assert busy["num_running_reqs"] == 1 and 0 < busy["token_usage"] <= 1
    assert pending.result(WAIT_S).status_code == 200


def test_slime_generate_reads_every_field_it_uses(web):
    """slime/rollout/sglang_rollout.py:95-105 (its sampling params), :176-190 (the payload: input_ids,
    return_logprob), :203-207 (tokens and log-probs from `output_token_logprobs`);
    slime/utils/types.py:165-205 (`cached_tokens`, `prompt_tokens`, `completion_tokens`),
    :405-415 (`weight_version`, `finish_reason.type`)."""
    sampling = dict(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=5, stop=None, stop_token_ids=None,
                    skip_special_tokens=False, no_stop_trim=True, spaces_between_special_tokens=False)
    prompt = [1, 4242, 4343, 4444, 4545, 4646, 4747, 4848]  # a prefix no other test here sends
    for turn in range(2):
        out = web.post("/generate", json={"input_ids": prompt, "sampling_params": sampling, "return_logprob": True})
        assert out.status_code == 200, out.text
        body = out.json()
        meta = body["meta_info"]
        tokens = [item[1] for item in meta["output_token_logprobs"]]
        log_probs = [item[0] for item in meta["output_token_logprobs"]]
        assert tokens == body["output_ids"] and len(log_probs) == len(tokens) == meta["completion_tokens"]
        assert meta["prompt_tokens"] == len(prompt) and meta["finish_reason"]["type"] in ("length", "stop")
        assert meta["weight_version"] == web.get("/get_weight_version").json()["weight_version"]
        assert isinstance(body["text"], str)
        if turn == 0:
            assert meta["cached_tokens"] == 0
        else:  # the repeat hits the cache: whole blocks of 4, the last prompt token always computed
            assert meta["cached_tokens"] == 4
