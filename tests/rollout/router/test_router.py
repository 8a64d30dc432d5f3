"""The router end to end: two real `rollout serve` replicas on loopback, an in-process router over
them (what `rollout route` runs), real clients.

The replicas and the router are shared by the module; every test leaves both replicas up,
unpaused, on the original weights (the kill test, last, replaces the one it kills).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import threading
from collections import Counter

import pytest

from inference import DynamicInferenceEngine, FinishReason, MaxSequenceLengthOverflowError, SamplingParams
from inference.config import StalePolicy
from rollout import AsyncRolloutClient, ClientSecurity, RolloutClient, RolloutRouter, RouterConfig, RouterProcess
from rollout.router.links import ReplicaState
from rollout.wire.codec import ProtocolError
from tests.rollout.router.router_util import (
    HEALTH,
    name_of,
    replica_stats,
    routed,
    start_replica,
    start_replicas,
    wait_up,
)
from tests.rollout.server.test_service import run_concurrent_clients
from tests.rollout.service_util import (
    SERVER_ARGS,
    WAIT_S,
    assert_tokens_then_samples,
    engine_config,
    expected_outputs,
    greedy,
    random_prompts,
    save_tiny_model,
    wait_for,
)


@pytest.fixture(scope="module")
def slow_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("slow")
    return [root / "r0", root / "r1"]


@pytest.fixture(scope="module")
def replica_procs(service_model_dir, slow_files):
    procs = start_replicas(service_model_dir, slow_files)
    try:
        yield procs  # NOTE: a list the kill test mutates (it replaces the replica it killed)
    finally:
        for p in procs:
            p.stop(grace_s=5.0)


@pytest.fixture(scope="module")
def router(replica_procs):
    r = RolloutRouter([p.address for p in replica_procs], RouterConfig(health=HEALTH)).start()
    try:
        wait_up(r, 2)
        yield r
    finally:
        r.stop()
        r.close()


@pytest.fixture
def client(router):
    with RolloutClient(router.address, timeout=WAIT_S) as c:
        yield c


# ---- many clients, exactly once, equal to in-process ---------------------------------------------


def test_four_clients_thousand_requests_through_two_replicas(router, replica_procs, reference):
    before = [replica_stats(p).get("requests_run", 0) for p in replica_procs]
    run_concurrent_clients(router, reference, total=1000)  # each answered once, greedy == in-process
    ran = [replica_stats(p).get("requests_run", 0) - b for p, b in zip(replica_procs, before)]
    assert sum(ran) == 1000 and min(ran) > 200, ran  # each ran once on exactly one replica; both worked


@pytest.mark.stress
def test_four_clients_five_thousand_requests_through_two_replicas(router, reference):
    seconds = run_concurrent_clients(router, reference, total=5000, seed=7)
    print(f"\n5000 requests through a router over 2 replicas, 4 clients, in {seconds:.1f} s")


def test_a_client_cannot_tell_it_from_a_server(router, client, reference):
    prompt = [5, 6, 7, 8]
    (want,) = expected_outputs(reference, [prompt], [greedy(12, n=2)])
    assert_tokens_then_samples(client, prompt, want, 12)  # tokens as sampled, then each sample

    async def main():
        async with AsyncRolloutClient(router.address, timeout=WAIT_S) as c:
            return await asyncio.gather(c.generate([prompt], n=2, sampling=greedy(12)), c.health(), c.is_sleeping())

    batch, health, asleep = asyncio.run(main())
    assert [r.completion_ids for r in batch] == want and health.healthy and asleep is False
    stream = client.stream([[5, 6, 7], [8, 9]], n=2, sampling=greedy(1500))
    wait_for(lambda: client.stats()["engine/active_request_count"] >= 1)
    client.abort(stream)  # the running samples finish now, with their partial tokens
    assert all(r.finish_reason is FinishReason.ABORT and len(r.completion_ids) < 1500 for r in stream.result(WAIT_S))
    with pytest.raises(ProtocolError, match="outside the vocabulary"):  # a replica's refusal, forwarded
        client.generate([[5, 999_999]], 1, greedy(2))
    with pytest.raises(ValueError, match="top_p"):
        client.generate([[5, 6]], 1, SamplingParams(top_p=float("nan")))


# ---- placement ---------------------------------------------------------------------------------


def test_a_group_and_its_samples_stay_on_one_replica(router, client, reference):
    prompts = random_prompts(6, 4, 12, seed=11)
    stream = client.stream(prompts, n=8, sampling=greedy(4))
    got = stream.result(WAIT_S)
    assert [r.completion_ids for r in got] == [s for g in expected_outputs(reference, prompts, [greedy(4, 8)] * 6)
                                               for s in g]
    assert all(len(router.placements(rid)) == 1 for rid in stream.request_ids)  # n samples: one replica
    # a GRPO group sent one sample per request: the group id keeps it together
    before = sum(routed(router, n)["group"] for n in router.replicas())
    group = client.stream(random_prompts(8, 4, 12, seed=12), n=1, sampling=greedy(4), group_id="grpo-group-1")
    group.result(WAIT_S)
    assert len({tuple(router.placements(rid)) for rid in group.request_ids}) == 1
    assert sum(routed(router, n)["group"] for n in router.replicas()) - before == 7


def test_a_session_stays_on_its_replica(router, client):
    conversation, where = [5, 6, 7, 8], []
    before = sum(routed(router, n)["session"] for n in router.replicas())
    for turn in range(5):
        others = client.stream(random_prompts(6, 4, 10, seed=20 + turn), 1, greedy(8))  # load elsewhere
        stream = client.stream([conversation], 1, greedy(6), session_id="agent-7")
        reply = stream.result(WAIT_S)[0]
        where += router.placements(stream.request_ids[0])
        conversation = conversation + reply.completion_ids + [9, 10 + turn]  # the next user turn
        others.result(WAIT_S)
    assert len(where) == 5 and len(set(where)) == 1
    assert sum(routed(router, n)["session"] for n in router.replicas()) - before == 4


def test_a_slowed_replica_receives_fewer_new_requests(router, replica_procs, slow_files):
    names = [name_of(router, p) for p in replica_procs]
    before = {n: sum(routed(router, n).values()) for n in names}
    slow_files[1].touch()  # replica 1's steps sleep from now on
    errors = []

    def worker(k: int) -> None:
        try:
            with RolloutClient(router.address, timeout=WAIT_S) as c:
                for prompt in random_prompts(6, 4, 10, seed=100 + k):
                    c.generate([prompt], 1, greedy(12))
        except BaseException as exc:  # noqa: BLE001 (re-raised on the test's thread)
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * WAIT_S)
    finally:
        slow_files[1].unlink()
    assert not errors, errors[0]
    got = {n: sum(routed(router, n).values()) - before[n] for n in names}
    assert sum(got.values()) == 48 and got[names[1]] < 0.6 * got[names[0]], got


def test_prefix_aware_until_the_replica_resets_its_cache(router, client, replica_procs):
    base = random_prompts(1, 24, 24, seed=31)[0]  # 6 blocks of 4
    first = client.stream([base + [7]], 1, greedy(2))
    first.result(WAIT_S)
    (home,) = router.placements(first.request_ids[0])
    wait_for(lambda: router.prefix_matches(base + [1])[home] == 6)
    before = {n: routed(router, n) for n in router.replicas()}
    for k in range(4):
        stream = client.stream([base + [40 + k, 41]], 1, greedy(2))
        stream.result(WAIT_S)
        assert router.placements(stream.request_ids[0]) == [home]
    assert routed(router, home)["prefix"] - before[home]["prefix"] == 4
    (proc,) = [p for p in replica_procs if p.address == router.replicas()[home].address]
    with RolloutClient(proc.address, timeout=WAIT_S) as direct:
        direct.reset_prefix_cache()  # behind the router's back: only its KV events tell
    wait_for(lambda: router.prefix_matches(base + [1])[home] == 0)
    before = {n: routed(router, n) for n in router.replicas()}
    client.generate([base + [50, 51]], 1, greedy(2))
    after = {n: routed(router, n) for n in router.replicas()}
    assert sum(after[n]["prefix"] - before[n]["prefix"] for n in after) == 0
    assert sum(after[n]["least_loaded"] - before[n]["least_loaded"] for n in after) == 1


# ---- control broadcast, versions, partial rollouts -----------------------------------------------


def test_control_is_broadcast_and_versions_reported(router, client, service_model_dir):
    client.pause("keep")
    assert all(replica_stats_state(router, n) == "paused" for n in router.replicas())
    client.continue_()
    assert client.is_sleeping() is False
    report = client.suspend()
    assert report.buffer_bytes > 0 and client.health().state == "suspended" and client.is_sleeping() is True
    assert all(replica_is_sleeping(router, n) for n in router.replicas())
    with pytest.raises(Exception, match="suspended"):
        client.generate([[5, 6, 7]], 1, greedy(2))
    client.resume()
    assert client.is_sleeping() is False
    version = client.policy_version
    assert client.update_weights(service_model_dir) == version + 1
    stats = client.stats()
    assert all(stats[f"replica/{n}/policy_version"] == version + 1 for n in router.replicas())
    assert stats["policy_version"] == version + 1 and stats["replicas_up"] == 2
    assert stats["engine/policy_version"] == version + 1  # the replicas' own figures, merged


def replica_stats_state(router, name: str) -> str:
    with RolloutClient(router.replicas()[name].address, timeout=WAIT_S) as c:
        return c.health().state


def replica_is_sleeping(router, name: str) -> bool:
    with RolloutClient(router.replicas()[name].address, timeout=WAIT_S) as c:
        return c.is_sleeping()


def _partial_rollout(client, router, new_weights, tokens: int = 300) -> tuple[int, list]:
    prompts = random_prompts(8, 4, 10, seed=41)
    version = client.policy_version
    start = client.stats()["engine/generated_tokens"]
    stream = client.stream(prompts, 1, greedy(tokens))
    wait_for(lambda: client.stats()["engine/generated_tokens"] - start >= 8 * 20)
    client.pause("keep")  # in flight: frozen with their KV
    assert client.update_weights(new_weights, policy="keep") == version + 1
    client.continue_()
    return version, prompts, stream.result(WAIT_S)


def test_keep_update_mid_run_gives_per_token_versions(router, client, service_model_dir, tmp_path):
    other = save_tiny_model(tmp_path / "other", seed=1)
    version, _, rollouts = _partial_rollout(client, router, other)
    for r in rollouts:
        assert len(r.completion_ids) == 300 and r.versions == sorted(r.versions)
        assert set(r.versions) <= {version, version + 1}  # changed once, monotonically
    assert sum(len(set(r.versions)) == 2 for r in rollouts) >= 4  # most spanned the update
    assert client.update_weights(service_model_dir) == version + 2  # back to the original weights


def test_max_staleness_zero_recomputes_what_spans_an_update(router, client, service_model_dir, tmp_path):
    other = save_tiny_model(tmp_path / "other", seed=1)
    before = client.stats().get("stale_recomputed", 0)
    router.set_staleness(0)
    try:
        version, prompts, rollouts = _partial_rollout(client, router, other)
    finally:
        router.set_staleness(None)
    fresh = DynamicInferenceEngine.from_pretrained(other, engine_config())
    want = expected_outputs(fresh, prompts, [greedy(300)] * len(prompts))
    assert [r.completion_ids for r in rollouts] == [w[0] for w in want]  # sampled again, under the new weights
    assert all(r.versions == [version + 1] * 300 for r in rollouts)
    assert client.stats()["stale_recomputed"] - before >= 4
    assert client.update_weights(service_model_dir) == version + 2


def test_max_staleness_zero_with_abort_ends_what_spans_an_update(router, client, reference, service_model_dir,
                                                                 tmp_path):
    other = save_tiny_model(tmp_path / "other", seed=1)
    before = client.stats().get("stale_aborted", 0)
    router.set_staleness(0, StalePolicy.ABORT)
    try:
        version, prompts, rollouts = _partial_rollout(client, router, other)
    finally:
        router.set_staleness(None, StalePolicy.RECOMPUTE)
    want = expected_outputs(reference, prompts, [greedy(300)] * len(prompts))
    aborted = [r for r in rollouts if r.finish_reason is FinishReason.ABORT]
    for r, w in zip(rollouts, want):  # never a token of the new version: ended, with the old one's tokens
        assert r.versions == [version] * len(r.completion_ids) and r.completion_ids == w[0][:len(r.completion_ids)]
        assert r.finish_reason is FinishReason.LENGTH or len(r.completion_ids) < 300
    assert len(aborted) >= 4 and client.stats()["stale_aborted"] - before == len(aborted)
    assert client.update_weights(service_model_dir) == version + 2


# ---- failover ----------------------------------------------------------------------------------


def test_a_frozen_replica_is_taken_out_within_the_deadline(router, client, replica_procs, reference):
    prompts = random_prompts(120, 2, 10, seed=51)
    want = expected_outputs(reference, prompts, [greedy(40)] * len(prompts))
    victim = replica_procs[0]
    name = name_of(router, victim)
    before = client.stats()
    stream = client.stream(prompts, 1, greedy(40))
    wait_for(lambda: all(i.in_flight > 0 for i in router.replicas().values()))
    os.kill(victim.pid, signal.SIGUSR1)  # its engine loop blocks at its next round
    try:
        # NOTE: out by the stall deadline, not by silence (it still answers Health); the deadline's
        # arithmetic is checked on a test clock (test_router_parts), never against this machine's
        out = wait_for(lambda: (info := router.replicas()[name]).state is ReplicaState.DOWN and info)
        assert "engine loop stalled" in out.reason, out.reason
        got = stream.result(WAIT_S)  # its requests finished elsewhere
    finally:
        os.kill(victim.pid, signal.SIGUSR2)
    assert [r.completion_ids for r in got] == [w[0] for w in want]
    wait_for(lambda: router.replicas()[name].state is ReplicaState.UP)  # taken back once healthy
    after = client.stats()
    assert after["takeouts"] - before.get("takeouts", 0) == 1 and after["failovers"] > before.get("failovers", 0)
    assert after["samples_sent"] - before.get("samples_sent", 0) == 120  # none twice (absent until counted)


def test_an_overlong_prompt_is_refused_as_overflow_by_the_router_and_no_replica_sees_it(router, client,
                                                                                       replica_procs):
    takeouts = {name: info.takeouts for name, info in router.replicas().items()}
    seen = [replica_stats(p).get("generates_received", 0) for p in replica_procs]
    limit = router.config.max_sequence_length
    # NOTE: 512 KiB of prompt: past the router's limit, and 8x the replicas' frame limit (had it been forwarded)
    with pytest.raises(MaxSequenceLengthOverflowError, match=f"max_sequence_length \\({limit}\\)"):
        client.generate([[5] * limit], 1, greedy(4))
    assert [replica_stats(p).get("generates_received", 0) for p in replica_procs] == seen
    # within the router's limit but past the replicas' (--max-seq-len 2048): a replica refuses it, typed
    with pytest.raises(MaxSequenceLengthOverflowError, match=r"max_sequence_length \(2048\)"):
        client.generate([[5] * 3000], 1, greedy(4))
    infos = router.replicas()
    assert all(i.state is ReplicaState.UP for i in infos.values())
    assert {name: info.takeouts for name, info in infos.items()} == takeouts
    assert len(client.generate([[5, 6]], 1, greedy(2))) == 1


def test_route_command_over_running_replicas(replica_procs, reference):
    with RouterProcess("--replicas", ",".join(p.address for p in replica_procs), "--health-every-s", "0.1") as proc, \
            RolloutClient(proc.address, timeout=WAIT_S) as c:
        wait_for(lambda: c.stats()["replicas_up"] == 2)
        prompts = random_prompts(20, 2, 8, seed=61)
        batch = c.generate(prompts, 2, greedy(5))
        assert [r.completion_ids for r in batch] == [s for g in expected_outputs(
            reference, prompts, [greedy(5, 2)] * 20) for s in g]
    assert proc.proc.returncode == 0


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (from /proc: no extra package)."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # not a process, or one that just ended
        if ppid == pid:
            out.append(int(entry))
    return out


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the children's /proc/PID/cmdline")
def test_spawned_replicas_get_the_token_outside_their_command_lines(service_model_dir):
    token = "tok-" + secrets.token_hex(8)
    env = dict(os.environ, ROLLOUT_TOKEN=token)  # NOTE: the router's own token, kept off its command line too
    with RouterProcess("--spawn", "1", "--model", str(service_model_dir), "--health-every-s", "0.1", "--",
                       *SERVER_ARGS, env=env, ready_timeout=WAIT_S) as proc:
        children = wait_for(lambda: [c for c in _children(proc.pid) if "rollout.cli serve" in _cmdline(c)])
        assert all(token not in _cmdline(c) for c in [proc.pid, *children]), [_cmdline(c) for c in children]
        with RolloutClient(proc.address, timeout=WAIT_S, security=ClientSecurity(token=token)) as c:
            wait_for(lambda: c.stats()["replicas_up"] == 1)  # the router authenticated to its child
            assert len(c.generate([[5, 6, 7]], 1, greedy(3))) == 1
    assert proc.proc.returncode == 0


def test_killing_a_replica_loses_no_request_and_answers_none_twice(router, client, replica_procs, reference,
                                                                   service_model_dir, slow_files):
    prompts = random_prompts(300, 2, 10, seed=71)
    want = expected_outputs(reference, prompts, [greedy(30)] * len(prompts))
    victim = replica_procs[1]
    name = name_of(router, victim)
    got = []
    try:
        for item in client.stream(prompts, 1, greedy(30)):
            got.append(item)
            if len(got) == 50:
                victim.proc.kill()
        out = wait_for(lambda: (info := router.replicas()[name]).state is ReplicaState.DOWN and info)
        assert "silent" in out.reason, out.reason  # a dead process answers nothing
    finally:
        victim.stop(grace_s=1.0)
        replica_procs[1] = start_replica(service_model_dir, slow_files[1])
        router.remove_replica(name)
        router.add_replica(replica_procs[1].address)
    assert Counter(r.group for r in got) == Counter(range(len(prompts)))  # each exactly once
    assert sorted((r.group, r.completion_ids) for r in got) == [(g, w[0]) for g, w in enumerate(want)]
    wait_up(router, 2)
    assert client.generate([[5, 6, 7]], 1, greedy(3))[0].completion_ids == \
        expected_outputs(reference, [[5, 6, 7]], [greedy(3)])[0][0]


