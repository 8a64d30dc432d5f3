"""The rollout service end to end: a real `rollout serve` process on loopback, real clients.

The server process is shared by the service tests (`server` in conftest: the tiny model,
`rollout serve` with test hooks); every test leaves it running, unpaused, on its original weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
import torch

from inference import DynamicInferenceEngine, FinishReason, MaxSequenceLengthOverflowError, SamplingParams
from rollout import AsyncRolloutClient, RolloutBackend, RolloutClient, RolloutEngine, TokenChunk
from rollout.rl.tracking import ServiceLogger, monitor_service
from rollout.server.server import RolloutServer, ServerConfig
from rollout.service.metrics import SERVICE_KEYS
from rollout.wire.codec import ProtocolError
from rollout.wire.kinds import ErrorCode
from tests.rollout.service_util import (
    HEALTH_DEADLINE_S,
    WAIT_S,
    assert_tokens_then_samples,
    engine_config,
    expected_outputs,
    greedy,
    random_prompts,
    save_tiny_model,
    wait_for,
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def client(server):
    with RolloutClient(server.address, timeout=WAIT_S) as c:
        yield c


# ---- many clients, exactly once, equal to in-process ---------------------------------------------


def run_concurrent_clients(server, reference, total: int, clients: int = 4, seed: int = 0) -> float:
    rng = __import__("random").Random(seed)
    prompts = random_prompts(total, 2, 12, seed=seed + 1)
    params = [greedy(rng.randint(1, 8), n=rng.choice([1, 1, 1, 2])) for _ in prompts]
    expected = expected_outputs(reference, prompts, params)
    with RolloutClient(server.address, timeout=WAIT_S) as probe:
        before = probe.stats()
        got: list = [None] * total
        errors: list = []

        def work(k: int) -> None:
            try:
                with RolloutClient(server.address, timeout=2 * WAIT_S) as c:
                    mine = list(range(k, total, clients))
                    streams = [(i, c.stream([prompts[i]], params[i].n, params[i])) for i in mine]
                    for i, s in streams:
                        got[i] = s.result()
            except BaseException as exc:  # noqa: BLE001 (re-raised on the test's thread)
                errors.append(exc)

        start = time.perf_counter()
        threads = [threading.Thread(target=work, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(4 * WAIT_S)
        seconds = time.perf_counter() - start
        assert not errors, errors[0]
        assert all(not t.is_alive() for t in threads)
        after = probe.stats()
    for i, rollouts in enumerate(got):
        assert [r.sample_index for r in rollouts] == list(range(params[i].n)), i  # each sample once
        assert [r.completion_ids for r in rollouts] == expected[i], i  # greedy == in-process
        assert all(r.prompt_ids == prompts[i] and r.finish_reason is FinishReason.LENGTH for r in rollouts)
    samples = sum(p.n for p in params)
    assert after["requests_run"] - before.get("requests_run", 0) == total  # each run once on the server
    assert after["samples_sent"] - before.get("samples_sent", 0) == samples  # each sample sent once
    assert after.get("resubmits", 0) == before.get("resubmits", 0)
    assert after["requests_in_flight"] == 0
    return seconds


def test_four_clients_thousand_requests_each_answered_once_equal_to_in_process(server, reference):
    run_concurrent_clients(server, reference, total=1000)


@pytest.mark.stress
def test_four_clients_five_thousand_requests(server, reference):
    seconds = run_concurrent_clients(server, reference, total=5000, seed=7)
    print(f"\n5000 requests through 4 clients in {seconds:.1f} s")


# ---- streaming, control, one interface ---------------------------------------------------------


def test_token_streaming_then_each_sample(client, reference):
    prompt = [5, 6, 7, 8]
    (want,) = expected_outputs(reference, [prompt], [greedy(12, n=2)])
    assert_tokens_then_samples(client, prompt, want, 12)


def test_control_messages(client, reference, service_model_dir, tmp_path):
    prompt, long = [9, 8, 7], greedy(600)
    # KEEP: a request admitted before the pause is frozen, then finishes after continue
    stream = client.stream([prompt], 1, long)
    wait_for(lambda: client.stats()["engine/active_request_count"] >= 1)
    client.pause("keep")
    frozen = client.stats()["engine/generated_tokens"]
    time.sleep(0.2)
    assert client.stats()["engine/generated_tokens"] == frozen and client.stats()["pauses"] >= 1
    client.continue_()
    assert len(stream.result(WAIT_S)[0].completion_ids) == 600
    # ABORT finishes what runs with its partial tokens; WAIT returns once drained
    stream = client.stream([prompt], 2, long)
    wait_for(lambda: client.stats()["engine/active_request_count"] >= 1)
    client.pause("abort")
    aborted = stream.result(WAIT_S)
    assert all(r.finish_reason is FinishReason.ABORT and len(r.completion_ids) < 600 for r in aborted)
    client.continue_()
    stream = client.stream([prompt], 1, long)
    wait_for(lambda: client.stats()["engine/active_request_count"] >= 1)  # admitted, so WAIT lets it finish
    client.pause("wait")
    assert client.stats()["requests_in_flight"] == 0
    assert len(stream.result(1.0)[0].completion_ids) == 600
    client.continue_()
    # suspend refuses new work, resume serves again
    assert client.is_sleeping() is False
    report = client.suspend()
    assert report.buffer_bytes > 0 and client.is_sleeping() is True
    with pytest.raises(Exception, match="suspended"):
        client.generate([prompt], 1, greedy(2))
    client.resume()
    assert client.is_sleeping() is False
    assert client.generate([prompt], 1, greedy(4))[0].completion_ids == expected_outputs(
        reference, [prompt], [greedy(4)])[0][0]
    # weights from a safetensors directory: a new version, outputs of the new weights; then back
    other = save_tiny_model(tmp_path / "other", seed=1)
    version = client.policy_version
    assert client.update_weights(other, policy="recompute") == version + 1
    fresh = RolloutEngine(other, engine_config())
    batch = client.generate([prompt], 1, greedy(6))
    assert batch[0].completion_ids == fresh.generate([prompt], 1, greedy(6))[0].completion_ids
    assert batch[0].versions == [version + 1] * 6 and batch.policy_version == version + 1
    assert client.update_weights(service_model_dir) == version + 2
    client.reset_prefix_cache()
    with pytest.raises(ProtocolError) as info:
        client.update_weights(tmp_path / "missing")
    assert info.value.code is ErrorCode.INVALID_REQUEST and "missing" in info.value.message
    stats = client.stats()
    assert set(SERVICE_KEYS) <= set(stats) and stats[f"tokens_v{version + 1}"] >= 6
    assert stats["suspends"] >= 1 and stats["weight_updates"] >= 2


def test_one_interface_in_process_and_remote(client, service_model_dir):
    local = RolloutEngine(service_model_dir, engine_config())

    def rl_step(backend: RolloutBackend) -> list[list[int]]:  # an RL loop's view: nothing else differs
        assert isinstance(backend, RolloutBackend)
        backend.reset_prefix_cache()
        batch = backend.generate([[3, 4, 5], [6, 7]], n=2, sampling=greedy(5))
        assert batch.group_size == 2 and batch.groups == [0, 0, 1, 1] and batch.stats.completion_tokens == 20
        streamed = backend.stream([[3, 4, 5]], n=1, sampling=greedy(5), session_id="agent-0",  # a router's hints,
                                  group_id="g-0").result(WAIT_S)  # accepted (and ignored) by one engine
        assert streamed[0].completion_ids == batch[0].completion_ids
        backend.pause("keep")
        backend.continue_()
        assert isinstance(backend.stats(), dict) and backend.policy_version >= 0
        return [r.completion_ids for r in batch]

    assert rl_step(local) == rl_step(client)


def test_async_client(server, reference):
    prompts = [[11, 12, 13], [14, 15]]
    want = expected_outputs(reference, prompts, [greedy(5, n=2)] * 2)

    async def main():
        async with AsyncRolloutClient(server.address, timeout=WAIT_S) as c:
            batch, health = await asyncio.gather(c.generate(prompts, n=2, sampling=greedy(5)), c.health())
            tokens = [i async for i in c.stream(prompts[:1], sampling=greedy(5), tokens=True)
                      if isinstance(i, TokenChunk)]
            await c.pause("keep")
            await c.continue_()
            await c.suspend()
            asleep = [await c.is_sleeping()]
            await c.resume()
            return batch, health, tokens, asleep + [await c.is_sleeping()]

    batch, health, tokens, asleep = asyncio.run(main())
    assert [r.completion_ids for r in batch] == [s for group in want for s in group]
    assert health.healthy and sum(len(t.token_ids) for t in tokens) == 5
    assert asleep == [True, False]


def test_reconnect_resubmits_and_each_sample_arrives_once(client, reference):
    prompts = random_prompts(200, 2, 10, seed=3)
    want = expected_outputs(reference, prompts, [greedy(30)] * len(prompts))
    before = client.stats()
    with RolloutClient(client.connection.address, timeout=WAIT_S) as flaky:
        stream = flaky.stream(prompts, 1, greedy(30))
        got = [next(stream)]
        flaky.reconnect()  # a new socket: the server sees a new peer; unanswered requests resubmitted
        got += list(stream)
        assert flaky.connection.reconnects == 1
    assert Counter(r.group for r in got) == Counter(range(len(prompts)))  # each exactly once
    assert sorted((r.group, r.completion_ids) for r in got) == [(g, w[0]) for g, w in enumerate(want)]
    after = client.stats()
    # NOTE: a counter is absent until it first counts (under xdist this may be the worker's first test)
    assert after["requests_run"] - before.get("requests_run", 0) == len(prompts)  # none ran twice
    assert after["resubmits"] - before.get("resubmits", 0) >= 1


def test_abort_and_per_call_timeouts(client):
    stream = client.stream([[5, 6, 7], [8, 9]], n=2, sampling=greedy(1500))
    wait_for(lambda: client.stats()["engine/active_request_count"] >= 1)
    client.abort(stream)  # the running samples finish now, with their partial tokens
    rollouts = stream.result(WAIT_S)
    assert [(r.group, r.sample_index) for r in rollouts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r.finish_reason is FinishReason.ABORT and len(r.completion_ids) < 1500 for r in rollouts)
    with pytest.raises(TimeoutError, match="aborted"):
        client.generate([[5, 6, 7]], 1, greedy(1500), timeout=0.05)  # past its deadline: aborted on the server
    wait_for(lambda: client.stats()["requests_in_flight"] == 0)


def test_bad_requests_are_refused_by_name_and_others_go_on(client, reference):
    stream = client.stream([[5, 5, 5]], 1, greedy(300))
    with pytest.raises(ProtocolError, match="outside the vocabulary") as info:
        client.generate([[5, 999_999]], 1, greedy(2))
    assert info.value.code is ErrorCode.INVALID_REQUEST
    with pytest.raises(MaxSequenceLengthOverflowError, match="max_sequence_length"):  # typed across the wire
        client.generate([[5, 6]], 1, SamplingParams(max_tokens=5000))
    with pytest.raises(ValueError, match="top_p"):
        client.generate([[5, 6]], 1, SamplingParams(top_p=float("nan")))  # refused before the wire
    assert stream.result(WAIT_S)[0].completion_ids == expected_outputs(reference, [[5, 5, 5]], [greedy(300)])[0][0]


def test_monitor_logs_the_service_figures(server, client, tmp_path, capsys):
    client.generate([[5, 6, 7]], 1, greedy(2))  # tokens of version 0 whatever ran before on this worker
    assert monitor_service(server.address, every_s=0.05, count=2, use_wandb=False, out_dir=str(tmp_path)) == 0
    rows = [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(set(SERVICE_KEYS) <= set(r) for r in rows)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ServiceLogger.header() and "v0:" in out[1]


# ---- faults ------------------------------------------------------------------------------------

KILLED_CLIENT = """
import sys, time
from inference import SamplingParams
from rollout import RolloutClient, TokenChunk
client = RolloutClient(sys.argv[1], lease_s=float(sys.argv[2]), timeout=120)
stream = client.stream([[5, 6, 7, 8], [9, 10]], n=2, sampling=SamplingParams(temperature=0, max_tokens=1900,
                       ignore_eos=True), tokens=True)
for item in stream:
    print("STARTED", flush=True)
    break
time.sleep(600)
"""


def test_killed_client_blocks_return_after_its_lease(server, client):
    lease_s = 1.0
    before = client.stats()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.address, str(lease_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = _readline(proc, WAIT_S)
        assert line.strip() == "STARTED", line
        client.pause("keep")  # freeze the 4 samples with their KV blocks (1900 tokens each: still running)
        held = client.stats()
        assert held["requests_in_flight"] == 2 and held["engine/kv_utilization"] > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(WAIT_S)
        killed = time.monotonic()
        stats = wait_for(lambda: (s := client.stats())["requests_in_flight"] == 0
                          and s["engine/kv_utilization"] == 0 and s)
        assert time.monotonic() - killed <= lease_s + 2.0
        assert stats["lease_aborted_requests"] - before.get("lease_aborted_requests", 0) == 2
        assert stats["engine/active_request_count"] == 0 and stats["engine/paused_request_count"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
        client.continue_()


def test_a_client_that_asks_for_a_long_lease_still_beats_within_the_default_cap(server):
    with RolloutClient(server.address, timeout=WAIT_S, lease_s=3600) as c:
        assert c.connection.heartbeat_s <= ServerConfig().max_lease_s / 4  # alive, it keeps the lease it is granted


def test_a_killed_client_that_asked_for_an_hour_long_lease_is_aborted_after_max_lease_s(service_model_dir):
    max_lease_s = 2.0
    engine = DynamicInferenceEngine.from_pretrained(service_model_dir, engine_config())
    server = RolloutServer(engine, ServerConfig(lease_s=1.0, max_lease_s=max_lease_s)).start()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.address, "3600"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        with RolloutClient(server.address, timeout=WAIT_S, lease_s=max_lease_s) as watcher:
            line = _readline(proc, WAIT_S)
            assert line.strip() == "STARTED", line
            watcher.pause("keep")  # NOTE: its samples stay in flight however fast the engine is
            assert watcher.stats()["requests_in_flight"] == 2
            proc.send_signal(signal.SIGKILL)
            proc.wait(WAIT_S)
            killed = time.monotonic()
            stats = wait_for(lambda: (s := watcher.stats())["requests_in_flight"] == 0 and s)
            assert time.monotonic() - killed <= max_lease_s + 3.0  # the cap, not the hour it asked for
            assert stats["lease_aborted_requests"] == 2 and stats["engine/kv_utilization"] == 0
            watcher.continue_()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(WAIT_S)
        server.stop()


def test_wedged_loop_is_unhealthy_within_the_deadline(server, client, reference):
    assert client.health().healthy
    os.kill(server.pid, signal.SIGUSR1)  # the engine loop blocks at its next round (test hook)
    try:
        wedged = time.monotonic()
        stream = client.stream([[4, 4, 4]], 1, greedy(3))
        health = wait_for(lambda: (h := client.health(timeout=5.0)) and not h.healthy and h, timeout=10.0)
        assert time.monotonic() - wedged <= HEALTH_DEADLINE_S + 1.5
        assert health.seconds_since_loop_tick > HEALTH_DEADLINE_S
    finally:
        os.kill(server.pid, signal.SIGUSR2)
    wait_for(lambda: client.health().healthy)
    assert stream.result(WAIT_S)[0].completion_ids == expected_outputs(reference, [[4, 4, 4]], [greedy(3)])[0][0]


def test_an_overlong_prompt_is_refused_at_the_door_without_the_engine(server, client):
    prompt = [5] * 4000  # over the server's --max-seq-len 2048 on its own, yet inside its 64 KiB frames
    os.kill(server.pid, signal.SIGUSR1)  # NOTE: with the engine loop wedged, only a refusal at the door can answer
    try:
        with pytest.raises(MaxSequenceLengthOverflowError, match=r"prompt \(4000\) \+ max_tokens \(4\)") as info:
            client.generate([prompt], 1, greedy(4), timeout=10.0)
        assert not info.value.is_transient  # permanent: a retry cannot fit it
    finally:
        os.kill(server.pid, signal.SIGUSR2)
    wait_for(lambda: client.health().healthy)
    assert len(client.generate([[5, 6]], 1, greedy(2))) == 1  # and serving on


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert out, f"no line from the client process within {timeout} s"
    return out[0]


