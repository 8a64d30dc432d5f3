"""The HTTP front in front of a router (`rollout route --spawn 2`): a chat session's turns stay on one
replica (the router's sticky sessions), keep their sampled ids, and hit that replica's prefix cache.

`slow`: a router and two replica processes (~10 s on 2 cores); the front's own session test runs
against one server in `test_http.py`."""

from __future__ import annotations

import openai
import pytest

from rollout.http.launch import start_front
from tests.rollout.http_util import MAX_LEN, MODEL, WAIT_S, save_tiny_chat_model

pytestmark = pytest.mark.slow
REPLICA_ARGS = ("--threads", "1", "--block-size", "4", "--num-blocks", "1024", "--max-requests", "32",
                "--max-seq-len", str(MAX_LEN))


@pytest.fixture(scope="module")
def routed_front(tmp_path_factory):
    from rollout.router.process import RouterProcess

    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-routed"))
    router = RouterProcess("--spawn", "2", "--model", str(model), "--", *REPLICA_ARGS, ready_timeout=2 * WAIT_S)
    try:
        front = start_front(router.address, model, served_model_name=MODEL, max_model_len=MAX_LEN, timeout=WAIT_S)
        try:
            yield front
        finally:
            front.stop()
    finally:
        router.stop(grace_s=10.0)


def test_session_sticks_to_one_replica_and_hits_its_cache(routed_front, one_torch_thread):
    import asyncio

    stats = lambda: asyncio.run(_stats(routed_front.front.client.connection.address))  # noqa: E731
    client = openai.OpenAI(base_url=f"{routed_front.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
    messages = [{"role": "system", "content": "You plan trips. Use tools."},
                {"role": "user", "content": "Book a train to Lyon."}]
    added = [{"role": "tool", "content": '{"train": "TGV 6601", "seats": 3}'}, {"role": "user", "content": "Go."}]
    turns, cached = [], []
    for k in range(3):
        before = stats()["engine/prefix_cached_tokens"]
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0,
                                             seed=k, extra_body={"session_id": "trip-1", "ignore_eos": True})
        cached.append(stats()["engine/prefix_cached_tokens"] - before)
        turns.append((out.model_extra["prompt_token_ids"], out.choices[0].model_extra["token_ids"]))
        messages = messages + [{"role": "assistant", "content": out.choices[0].message.content}, added[k % 2]]
    for (p0, s0), (p1, _) in zip(turns, turns[1:]):
        assert p1[:len(p0) + len(s0)] == p0 + s0
    for k in (1, 2):
        assert cached[k] >= len(turns[k - 1][0]) + len(turns[k - 1][1]) - 4, cached
    figures = stats()
    routed = {key.split("/")[1]: 0 for key in figures if key.startswith("replica/")}
    for key, value in figures.items():
        if key.startswith("replica/") and "/routed_" in key:
            routed[key.split("/")[1]] += int(value)
    session = sum(int(v) for k, v in figures.items() if k.endswith("/routed_session"))
    assert session == 2 and sorted(routed.values()) == [0, 3], figures  # every turn on one replica
    client.close()


async def _stats(address: str) -> dict:
    from rollout import AsyncRolloutClient

    async with AsyncRolloutClient(address, timeout=WAIT_S) as c:
        return await c.stats()


def test_metrics_through_the_router_sum_the_fleet(routed_front, one_torch_thread):
    """`/metrics` on a front over the router: the fleet's counters, summed over its replicas."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def generated() -> float:
        text = httpx.get(f"{routed_front.url}/metrics", timeout=WAIT_S).text
        family = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:generation_tokens")
        return family.samples[0].value

    before = generated()
    client = openai.OpenAI(base_url=f"{routed_front.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
    client.completions.create(model=MODEL, prompt=[[1, 5, 6], [1, 7, 8]], max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    client.close()
    import time

    deadline = time.monotonic() + WAIT_S  # NOTE: a replica reports its tokens once its step loop has gone round
    while generated() - before < 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert generated() - before == 8


def test_vllm_weight_phases_through_the_router_give_each_replica_its_rank(routed_front, tmp_path, one_torch_thread):
    """A vLLM trainer reads `/get_world_size` (the router's two replicas, as data parallel ranks)
    and sends one `rank_offset`; the router gives replica i `rank_offset + i`, every replica joins,
    takes the packed broadcast and commits: all serve the new weights, none is taken out."""
    import httpx
    from safetensors.torch import load_file

    from inference import DynamicInferenceEngine, SamplingParams
    from tests.rollout.http_util import engine_config
    from weight_sync.vllm_trainer import VllmWeightTrainer

    web = httpx.Client(base_url=routed_front.url, timeout=WAIT_S)
    assert web.get("/get_world_size").json() == {"world_size": 2}
    assert web.get("/get_world_size", params={"include_dp": "false"}).json() == {"world_size": 1}
    new_dir = save_tiny_chat_model(tmp_path / "new", seed=1)
    prompts = [[1, 400, 500, 600], [50, 60, 70], [7, 8, 9, 10], [300, 200]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fresh = DynamicInferenceEngine.from_pretrained(new_dir, engine_config())
    expected = [fresh.generate([p], [params], timeout=WAIT_S)[0].generated_token_ids for p in prompts]
    version = int(web.get("/weight_info").json()["weight_version"])
    trainer = VllmWeightTrainer([routed_front.url], backend="gloo", timeout_s=20.0)
    try:
        trainer.init()
        assert trainer.group.world_size == 3
        trainer.update(sorted(load_file(new_dir / "model.safetensors").items()), packed=True,
                       weight_version=str(version + 1))
    finally:
        trainer.close()
    assert web.get("/weight_info").json() == {"weight_version": str(version + 1)}
    for _ in range(2):  # NOTE: each prompt twice over, so both replicas answer some
        out = [web.post("/inference/v1/generate", json={"token_ids": p, "sampling_params": {
            "temperature": 0, "max_tokens": 6, "ignore_eos": True}}).json()["choices"][0]["token_ids"] for p in prompts]
        assert out == expected
    assert web.get("/get_world_size").json() == {"world_size": 2}  # neither replica taken out
    web.close()


def test_after_a_deep_sleep_the_router_says_its_replicas_do_not_generate(routed_front, tmp_path_factory,
                                                                        one_torch_thread):
    """The router's view of each replica, its health and its HTTP front's `/health` say that a
    deep sleep left the fleet without weights, until a weight update loads them on every replica."""
    import asyncio

    import httpx

    stats = lambda: asyncio.run(_stats(routed_front.front.client.connection.address))  # noqa: E731
    model = str(routed_front.front.config.model_path)
    with httpx.Client(base_url=routed_front.url, timeout=WAIT_S) as web:
        assert web.post("/sleep", params={"level": 2}).status_code == 200
        assert web.post("/wake_up").status_code == 200
        figures = _until(stats, lambda f: sum(k.endswith("/serving_error") for k in f) == 2)
        assert all("deep sleep" in v for k, v in figures.items() if k.endswith("/serving_error"))
        health = web.get("/health")
        assert health.status_code == 200 and health.json()["generating"] is False
        refused = web.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["x-should-retry"] == "false"
        assert web.post("/update_weights_from_disk", json={"model_path": model}).status_code == 200
        _until(stats, lambda f: not any(k.endswith("/serving_error") for k in f))
        assert web.get("/health").content == b""
        served = web.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
        assert served.status_code == 200


def _until(read, holds, timeout_s: float = WAIT_S):
    """`read()` again until `holds` its value (the router hears each replica's health every tick)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if holds(value) or time.monotonic() > deadline:
            assert holds(value), value
            return value
        time.sleep(0.1)
