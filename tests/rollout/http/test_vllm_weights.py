"""vLLM's four weight-transfer phases on a real `rollout serve --http` process, driven over HTTP by
our vLLM-layout trainer (`weight_sync.vllm_trainer`) broadcasting over gloo on loopback: greedy
outputs then equal an engine loaded with the new weights; bad input gets vLLM's status codes and
bodies and the server keeps serving; a failed or partial update leaves the old weights serving."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.rollout.http_util import WAIT_S, greedy_ids, http_server_process, in_flight, old_and_new_models, wait_running
from weight_sync.vllm_layout import pack_chunks, update_info
from weight_sync.vllm_trainer import VllmPhaseError, VllmWeightTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = [[1, 400, 500, 600], [50, 60, 70]]
SYNC_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return old_and_new_models(tmp_path_factory.mktemp("vllm-weights"))


@pytest.fixture(scope="module")
def server(dirs):
    # NOTE: a short bound on every wait of an update, so a trainer that dies mid-broadcast costs seconds
    with http_server_process(dirs[0], "--weight-sync-timeout-s", str(SYNC_TIMEOUT_S)) as proc:
        yield proc


@pytest.fixture(scope="module")
def expected(dirs):
    """Greedy ids of each prompt under the old and the new weights (engines in this process)."""
    out = {key: greedy_ids(d, PROMPTS) for key, d in zip(("old", "new"), dirs)}
    assert out["old"] != out["new"]
    return out


@pytest.fixture(scope="module")
def weights(dirs):
    return {key: sorted(load_file(d / "model.safetensors").items()) for key, d in zip(("old", "new"), dirs)}


@pytest.fixture(scope="module")
def trainer(server):
    trainer = VllmWeightTrainer([server.http_url], backend="gloo", timeout_s=20.0)
    try:
        trainer.init()
        yield trainer
    finally:
        trainer.close()


@pytest.fixture
def web(server):
    with httpx.Client(base_url=server.http_url, timeout=WAIT_S) as c:
        yield c


def greedy(web: httpx.Client) -> list[list[int]]:
    outs = web.post("/generate", json={"input_ids": PROMPTS, "sampling_params": {
        "temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}).json()
    return [o["output_ids"] for o in outs]


def version(web: httpx.Client) -> int:
    return int(web.get("/get_weight_version").json()["weight_version"])


def test_the_four_phases_packed_then_unpacked_equal_an_engine_on_those_weights(trainer, web, weights, expected):
    assert greedy(web) == expected["old"]
    v = version(web)
    # packed, several chunks (the embedding alone is 6 MiB), the model in two /update_weights calls;
    # until the finish the old weights serve
    trainer.each("/start_weight_update", {"is_checkpoint_format": True})
    half = len(weights["new"]) // 2
    sent = trainer.send(weights["new"][:half], packed=True, buffer_bytes=1 << 20, num_buffers=3)
    sent += trainer.send(weights["new"][half:], packed=True, buffer_bytes=1 << 20, num_buffers=3)
    assert sent == sum(t.numel() * t.element_size() for _, t in weights["new"])
    assert (version(web), greedy(web)) == (v, expected["old"])
    trainer.each("/finish_weight_update", {"weight_version": str(v + 1)})
    assert version(web) == v + 1
    assert greedy(web) == expected["new"]
    trainer.update(weights["old"], packed=False)  # vLLM's one broadcast a tensor; the next version
    assert version(web) == v + 2
    assert greedy(web) == expected["old"]


def test_a_keep_update_mid_generation_splits_its_spans_at_the_new_version(trainer, server, web, weights, expected):
    """A trainer's sync as vLLM's RL docs write it: `/pause?mode=keep` with a request in flight,
    the four phases, `/resume`: the request finishes, its tokens before the pause carry the old
    version and those after it the new one; then the new weights serve."""
    old = version(web)
    pending = in_flight(server.http_url, 300)
    wait_running(web)
    assert web.post("/pause", params={"mode": "keep"}).status_code == 200
    trainer.update(weights["new"], packed=True, weight_version=str(old + 1))
    assert web.post("/resume").status_code == 200
    choice = pending.result(WAIT_S).json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 300
    spans = choice["weight_versions"]
    assert [s["version"] for s in spans] == [old, old + 1]
    assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < 300 and spans[1]["end"] == 300
    assert greedy(web) == expected["new"]
    trainer.update(weights["old"], packed=True, weight_version=str(old + 2))
    assert greedy(web) == expected["old"]


def vllm_error(message: str, type: str = "Bad Request", code: int = 400) -> dict:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def test_bad_input_gets_vllms_status_and_body_and_the_server_keeps_serving(server, web, expected):
    assert web.post("/init_weight_transfer_engine", json={}).json() == vllm_error(
        "Missing 'init_info' in request body")
    assert web.post("/update_weights", json={"other": 1}).json() == vllm_error("Missing 'update_info' in request body")
    r = web.post("/update_weights", content=b"{not json", headers={"content-type": "application/json"})
    assert (r.status_code, r.json()) == (400, vllm_error("Invalid JSON format"))
    info = {"names": ["model.norm.weight"], "dtype_names": ["float32", "float32"], "shapes": [[32]]}
    r = web.post("/update_weights", json={"update_info": info})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert "`dtype_names` should be of the same size as `names`: got 2 and 1" in r.json()["error"]["message"]
    r = web.post("/update_weights", json={"update_info": {**info, "dtype_names": ["float32"], "what": 1}})
    assert r.status_code == 400 and "what" in r.json()["error"]["message"]
    r = web.post("/update_weights", json={"update_info": {**info, "ipc_handles": {}}})
    assert r.status_code == 400 and "pickled" in r.json()["error"]["message"]
    r = web.post("/init_weight_transfer_engine", json={"init_info": {"master_address": "127.0.0.1",
                                                                    "master_port": 1, "world_size": 2}})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Invalid init_info for ")
    assert "rank_offset" in r.json()["error"]["message"]
    r = web.post("/finish_weight_update", json={"weight_version": "v1"})  # nothing is open
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert server.proc.poll() is None
    assert greedy(web) == expected["old"]


def test_a_failed_or_partial_update_leaves_the_old_weights_serving(trainer, web, weights, expected):
    v = version(web)
    new = weights["new"]
    # a partial update: half the tensors, then finish: the commit refuses, nothing changed
    with pytest.raises(VllmPhaseError) as refused:
        trainer.update(new[: len(new) // 2], packed=True, buffer_bytes=1 << 20)
    assert refused.value.phase == "/finish_weight_update" and refused.value.status == 400
    assert (version(web), greedy(web)) == (v, expected["old"])
    # a tensor of another shape: refused before it loads, its broadcasts drained, the update aborted
    wrong = [(n, torch.zeros(3, 3) if n == "model.norm.weight" else t) for n, t in new]
    with pytest.raises(VllmPhaseError) as refused:
        trainer.update(wrong, packed=True, buffer_bytes=1 << 20)
    assert refused.value.phase == "/update_weights" and refused.value.status == 400
    assert (version(web), greedy(web)) == (v, expected["old"])
    # a weight_version the commit cannot make (not the next one): refused at finish, nothing changed
    with pytest.raises(VllmPhaseError) as refused:
        trainer.update(new, packed=False, weight_version=str(v + 5))
    assert refused.value.phase == "/finish_weight_update" and refused.value.status == 400
    assert (version(web), greedy(web)) == (v, expected["old"])
    # the group still works: a whole update commits
    trainer.update(new, packed=True, buffer_bytes=1 << 20)
    assert (version(web), greedy(web)) == (v + 1, expected["new"])
    trainer.update(weights["old"], packed=True)
    assert greedy(web) == expected["old"]


def test_a_trainer_gone_mid_broadcast_leaves_the_old_weights_serving(trainer, server, web, weights, expected):
    v = version(web)
    new = weights["new"]
    trainer.each("/start_weight_update", {})
    body = {"update_info": update_info(new, packed=True, buffer_bytes=1 << 20)}
    call = trainer.post_async(server.http_url, "/update_weights", body)
    trainer.group.broadcast(next(iter(pack_chunks([t for _, t in new], 1 << 20))))  # the first chunk only
    trainer.close_group()  # NOTE: the trainer is gone: the engine's next wait runs out
    with pytest.raises(VllmPhaseError) as refused:
        call.result(timeout=SYNC_TIMEOUT_S * 5)
    assert refused.value.status >= 500
    assert (version(web), greedy(web)) == (v, expected["old"])
    trainer.init()  # a new group, as vLLM's trainers make one after a failure
    trainer.update(new, packed=True, buffer_bytes=1 << 20)
    assert (version(web), greedy(web)) == (v + 1, expected["new"])
    trainer.update(weights["old"], packed=True)
    assert greedy(web) == expected["old"]


def test_update_weights_without_start_commits_once_the_model_is_complete(trainer, web, weights, expected):
    """vLLM's single-call clients (before the start / finish phases): the call that completes the
    model commits it; a call with part of it keeps the update open for the rest."""
    v = version(web)
    new = weights["new"]
    trainer.send(new[:1], packed=True)
    assert (version(web), greedy(web)) == (v, expected["old"])
    trainer.send(new[1:], packed=False)
    assert (version(web), greedy(web)) == (v + 1, expected["new"])
    trainer.send(weights["old"], packed=True)
    assert (version(web), greedy(web)) == (v + 2, expected["old"])


def test_colocated_cycle_sleep_level_2_wake_weights_update_wake_kv(trainer, web, weights, expected):
    """SkyRL's colocated order: weights dropped by sleep level 2, woken alone, the four phases load
    new ones, then the KV cache wakes and the engine serves them."""
    v = version(web)
    assert web.post("/sleep", params={"level": 2}).status_code == 200
    assert web.post("/wake_up", params={"tags": "weights"}).status_code == 200
    trainer.update(weights["new"], packed=True, buffer_bytes=1 << 20, weight_version=str(v + 1))
    assert web.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert web.get("/is_sleeping").json() == {"is_sleeping": False}
    assert (version(web), greedy(web)) == (v + 1, expected["new"])
    trainer.update(weights["old"], packed=True)
    assert greedy(web) == expected["old"]


def test_one_pinned_vllm_version():
    from rollout.http.vllm.vllm_routes import VLLM_API_VERSION
    from weight_sync.vllm_layout import VLLM_VERSION

    assert VLLM_VERSION == VLLM_API_VERSION


def test_prime_rl_weight_dir_is_a_disk_update_committed_at_once(web, dirs, expected):
    v = version(web)
    r = web.post("/update_weights", json={"weight_dir": str(dirs[1])})
    assert (r.status_code, r.json()) == (200, {"message": "Weights updated"})
    assert (version(web), greedy(web)) == (v + 1, expected["new"])
    r = web.post("/update_weights", json={"weight_dir": str(dirs[1] / "missing")})
    assert r.status_code == 400 and version(web) == v + 1
    assert web.post("/update_weights", json={"weight_dir": str(dirs[0])}).status_code == 200
    assert greedy(web) == expected["old"]


def test_skyrls_collective_rpc_phases_load_the_weights(trainer, web, weights, expected):
    """SkyRL's path (its worker extension's methods through `/collective_rpc`): start, the NCCL-style
    update with the broadcasts, finish; an unknown method and pickled IPC handles are refused."""
    from weight_sync.transports import vllm_broadcast

    v = version(web)
    rpc = lambda method, **kwargs: trainer.each("/collective_rpc", {"method": method, "kwargs": kwargs})  # noqa: E731
    rpc("skyrl_start_weight_update", is_checkpoint_format=True)
    named = weights["new"]
    body = {"method": "update_weights_nccl", "kwargs": {"update_info": update_info(named, packed=True)}}
    calls = [trainer.post_async(url, "/collective_rpc", body) for url in trainer.engines]
    vllm_broadcast.send(trainer.group, [t for _, t in named], packed=True)
    for call in calls:
        call.result(timeout=2 * WAIT_S)
    assert (version(web), greedy(web)) == (v, expected["old"])  # the old weights serve until the finish
    rpc("skyrl_finish_weight_update")
    assert (version(web), greedy(web)) == (v + 1, expected["new"])
    nemo = web.post("/collective_rpc", json={"method": "init_collective", "kwargs": {"rank_prefix": 1}})
    assert nemo.status_code == 400 and "StatelessProcessGroup" in nemo.json()["error"]["message"]
    unknown = web.post("/collective_rpc", json={"method": "free_the_gpu"})
    assert unknown.status_code == 400 and "skyrl_start_weight_update" in unknown.json()["error"]["message"]
    refused = web.post("/collective_rpc", json={"method": "update_weights_ipc", "kwargs": {"update_info": {}}})
    assert refused.status_code == 400 and "pickled" in refused.json()["error"]["message"]
    trainer.update(weights["old"], packed=True)
    assert greedy(web) == expected["old"]
