"""The router's parts without replicas: placement, the KV event log, fleet sync plans, broadcast
outcomes, health verdicts, and a router with no replica up. Stateful parts against models (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from inference import DynamicInferenceEngine, FinishReason, SamplingParams
from inference.config import PauseMode
from inference.kv_cache import block_hashes
from inference.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from rollout import RolloutClient, RolloutRouter, RouterConfig
from rollout.router.attempts import Attempt, Route, too_stale
from rollout.router.broadcast import Fanout, FleetState, merge_stats, sum_stats
from rollout.router.links import HealthConfig, ReplicaLink, ReplicaState
from rollout.router.placement import Placement, PlacementConfig, Reason
from rollout.router.replicas import ReplicaSet
from rollout.server.kv_log import KvEventLog
from rollout.server.server import RolloutServer
from rollout.service.metrics import ServiceMetrics
from rollout.service.registry import Record
from rollout.wire.codec import ProtocolError, decode_request
from rollout.wire.kinds import ErrorCode, Kind
from rollout.wire.kv_events import KvEvent, KvOp
from rollout.wire.messages import (
    Abort,
    Continue,
    ErrorReply,
    Generate,
    HealthInfo,
    KvEvents,
    LoraInfo,
    Pause,
    Result,
    Resume,
    SampleOutput,
    Suspend,
    SyncLora,
    TokenDelta,
    UpdateWeights,
)
from tests.rollout.conftest import small_engine_config, tiny_policy
from tests.rollout.service_util import greedy
from weight_sync import AdapterSource, DiskSource, DistributedSource
from weight_sync.buckets import manifest_for

# ---- placement -----------------------------------------------------------------------------------


def stored(hashes) -> KvEvent:
    return KvEvent(KvOp.STORED, list(hashes))


def test_placement_precedence_group_session_prefix_least_loaded():
    p = Placement(PlacementConfig(load_imbalance=2.0, load_slack_tokens=100))
    for name in ("a", "b", "c"):
        p.add(name)
    hashes = block_hashes(list(range(20)), 4)
    p.kv_events("b", [stored(hashes[:3])])
    assert p.choose(["a", "b", "c"], hashes) == ("b", Reason.PREFIX)  # the longest cached prefix
    p.assign("c", Reason.LEAST_LOADED, 10, session_id="s", group_id="g", version=0)
    assert p.choose(["a", "b", "c"], hashes, session_id="s") == ("c", Reason.SESSION)
    assert p.choose(["a", "b", "c"], hashes, session_id="s", group_id="g") == ("c", Reason.GROUP)
    assert p.group_of("g") == ("c", 0)
    assert p.choose(["a", "b"], hashes, session_id="s", group_id="g") == ("b", Reason.PREFIX)  # c is out
    p.assign("b", Reason.PREFIX, 1000)  # far above the others: the prefix no longer wins
    assert p.choose(["a", "b"], hashes) == ("a", Reason.LEAST_LOADED)
    p.release("b", 1000)
    p.kv_events("b", [KvEvent(KvOp.CLEARED)])  # e.g. its prefix cache was reset
    assert p.match("b", hashes) == 0 and p.choose(["a", "b"], hashes)[1] is Reason.LEAST_LOADED
    p.kv_events("b", [stored(hashes), KvEvent(KvOp.REMOVED, [hashes[1]])])
    assert p.match("b", hashes) == 1  # a chain is matched up to its first missing block


def test_placement_ties_go_to_the_replica_given_fewer_requests():
    p = Placement()
    for name in ("a", "b"):
        p.add(name)
    picks = []
    for _ in range(6):
        name, _reason = p.choose(["a", "b"], [])
        p.assign(name, Reason.LEAST_LOADED, 0)
        picks.append(name)
    assert picks.count("a") == picks.count("b") == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["assign", "release", "events", "remove", "add"]),
                          st.integers(0, 3), st.integers(0, 500), st.booleans()), max_size=60))
def test_placement_load_matches_a_model_and_choices_are_candidates(ops):
    p = Placement(PlacementConfig(max_index_hashes=8))
    model: dict[str, int] = {}
    for op, k, cost, flag in ops:
        name = f"r{k}"
        if op == "add" or (op != "remove" and name not in model):
            p.add(name)
            model.setdefault(name, 0)
        if op == "assign":
            hashes = block_hashes(list(range(cost % 40)), 4)
            p.assign(name, Reason.PREFIX, cost, hashes, session_id=str(k) if flag else None)
            model[name] += cost
        elif op == "release":
            p.release(name, cost)
            model[name] = max(0, model[name] - cost)
        elif op == "events":
            p.kv_events(name, [stored(block_hashes(list(range(cost % 40)), 4))], reset=flag)
        elif op == "remove":
            p.remove(name)
            model.pop(name, None)
        assert p.load == model
        if model:
            candidates = sorted(model)
            chosen, _ = p.choose(candidates, block_hashes(list(range(cost % 40)), 4), session_id=str(k))
            assert chosen in candidates


# ---- KV event log --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=80), st.integers(1, 10), st.lists(st.integers(0, 100), max_size=10))
def test_kv_event_log_reads_what_a_model_holds(sizes, capacity, cursors):
    log = KvEventLog(block_size=4, capacity=capacity)
    model, first = [], 0  # the model: every event, and the first one the log still holds
    for i, size in enumerate(sizes):
        event = AllBlocksCleared() if size == 0 else BlockStored(tuple(range(1 + i, 1 + i + size)), 0,
                                                                  tuple(range(size)), 4)
        log(event)
        model.append(event)
        if len(model) - first >= 2 * capacity:  # trimmed in halves, keeping the last `capacity`
            first = len(model) - capacity
    assert log.next == len(model)
    for since in cursors + [log.next]:
        batch = log.read(since, max_events=3)
        reset = not first <= since <= len(model)
        assert batch.reset == reset and batch.start == (first if reset else since)
        assert batch.events == [KvEvent(KvOp.CLEARED) if isinstance(e, AllBlocksCleared)
                                else KvEvent(KvOp.STORED, list(e.block_hashes), e.salt, e.version, e.computed_by)
                                for e in model[batch.start:batch.start + 3]]
        assert batch.next == batch.start + len(batch.events) and batch.more == (batch.next < len(model))


def test_kv_event_log_cuts_replies_by_hashes_and_keeps_at_least_one():
    log = KvEventLog(block_size=4)
    log(BlockStored(tuple(range(1, 11)), 0, tuple(range(10)), 4))
    log(BlockRemoved((3,)))
    assert [len(e.hashes) for e in log.read(0, max_hashes=4).events] == [10]  # one event whatever its size
    batch = log.read(0, max_hashes=10)
    assert len(batch.events) == 1 and batch.more and log.read(batch.next).events[0].op is KvOp.REMOVED


def test_server_answers_kv_events_without_the_engine():
    engine = DynamicInferenceEngine.from_pretrained(tiny_policy(hidden=32, layers=1), small_engine_config())
    server = RolloutServer(engine).start()
    try:
        with RolloutClient(server.address, timeout=30) as c:
            c.generate([list(range(3, 12))], 1, greedy(2))  # 9 tokens: 2 full blocks of 4 before the last
            salted = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, cache_salt="run-7")
            c.generate([list(range(3, 12))], 1, salted)  # the same prompt in its own chain
            c.reset_prefix_cache()
            result = c._call(KvEvents(request_id="k-1", since=0), None)
    finally:
        server.stop()
    batch = result.kv_events
    assert batch.block_size == 4 and not batch.reset and batch.start == 0
    ops = [e.op for e in batch.events]
    assert ops[0] is KvOp.STORED and ops[-1] is KvOp.CLEARED
    stored = {h for e in batch.events if e.op is KvOp.STORED for h in e.hashes}
    prompt = np.arange(3, 12, dtype=np.int32)
    plain, salty = Route().prompt_hashes(prompt, 4, 0), Route().prompt_hashes(prompt, 4, 0, "run-7")
    assert plain == block_hashes(list(range(3, 11)), 4, extra_key=0) and not set(plain) & set(salty)
    assert set(plain) <= stored and set(salty) <= stored  # the router's placement sees both as the replica


# ---- fleet, broadcast, health --------------------------------------------------------------------


def test_fleet_sync_plans_bring_a_replica_in_step():
    ids = iter(f"s{i}" for i in range(100)).__next__
    fleet = FleetState(version=3)
    assert fleet.sync_plan(3, "running", ids) == []
    assert fleet.sync_plan(0, "running", ids) is None  # another version and no update known to replay
    fleet.applied(UpdateWeights(request_id="u", source=DiskSource(path="/w")), 4)
    fleet.applied(Pause(request_id="p", mode=PauseMode.WAIT), None)
    plan = fleet.sync_plan(0, "suspended", ids)
    assert [type(m) for m in plan] == [Resume, UpdateWeights, Pause]
    assert plan[1].source.version == 4 and plan[1].source.path == "/w" and plan[2].mode is PauseMode.KEEP
    fleet.applied(Continue(request_id="c"), None)
    fleet.applied(Suspend(request_id="s"), None)
    assert fleet.engine_state == "suspended" and fleet.sync_plan(4, "suspended", ids) == []
    assert [type(m) for m in fleet.sync_plan(4, "paused", ids)] == [Continue, Suspend]


def test_a_weight_sync_broadcast_is_never_replayed_to_a_lagging_replica():
    from weight_sync import Manifest

    ids = iter(f"s{i}" for i in range(100)).__next__
    fleet = FleetState(version=3)
    fleet.applied(UpdateWeights(request_id="u", source=DiskSource(path="/w")), 4)
    assert [type(m) for m in fleet.sync_plan(3, "running", ids)] == [UpdateWeights]
    # a group broadcast (or a shared-memory segment) is gone once the trainer moved on: a replica
    # left behind waits for the next update instead of blocking on a transfer nobody sends
    manifest = Manifest(names=["w"], dtypes=["float32"], shapes=[[2]])
    fleet.applied(UpdateWeights(request_id="v", source=DistributedSource(manifest=manifest)), 5)
    assert fleet.version == 5 and fleet.sync_plan(4, "running", ids) is None
    assert fleet.sync_plan(5, "running", ids) == []


def test_fanout_outcome_and_merged_figures():
    fan = Fanout(b"peer", Pause(request_id="c-1", mode=PauseMode.KEEP))
    for name in ("a", "b", "c"):
        fan.add(name, f"x-{name}")
    fan.on_reply("a", Result(request_id="x-a", request_kind=Kind.PAUSE, policy_version=2, stats={"n": 1}))
    fan.on_reply("b", ErrorReply(code=ErrorCode.ENGINE_STATE, message="suspended", request_id="x-b"))
    assert not fan.done
    fan.drop("c")  # taken out before it answered
    assert fan.done and fan.failed == ["b"] and fan.succeeded == ["a"]
    out = fan.outcome(Kind.PAUSE, 2)
    assert isinstance(out, Result) and out.request_id == "c-1" and out.policy_version == 2
    refused = Fanout(b"peer", Pause(request_id="c-2", mode=PauseMode.KEEP))
    refused.add("a", "y")
    refused.on_reply("a", ErrorReply(code=ErrorCode.ENGINE_STATE, message="no", request_id="y"))
    assert refused.outcome(Kind.PAUSE, 2).code is ErrorCode.ENGINE_STATE
    # an adapter sync is refused if any replica refused it (a trainer must not go on as if all committed)
    named = [(f"base_model.model.model.layers.0.self_attn.q_proj.lora_{ab}.weight", torch.zeros(shape))
             for ab, shape in (("A", (4, 32)), ("B", (32, 4)))]
    source = AdapterSource(name="policy", rank=4, alpha=8.0, target_modules=["q_proj"],
                           payload=DistributedSource(manifest=manifest_for(named, version=2)))
    synced = Fanout(b"peer", SyncLora(request_id="c-3", source=source))
    for name in ("a", "b"):
        synced.add(name, f"z-{name}")
    synced.on_reply("a", Result(request_id="z-a", request_kind=Kind.SYNC_LORA, loras=[
        LoraInfo(name="policy", version=2, rank=4)]))
    synced.on_reply("b", ErrorReply(code=ErrorCode.INVALID_REQUEST, message="checksum", request_id="z-b"))
    out = synced.outcome(Kind.SYNC_LORA, 2)
    assert isinstance(out, ErrorReply) and "checksum" in out.message and "replicas b" in out.message
    assert sum_stats([{"bytes": 1, "k": "x"}, {"bytes": 2}]) == {"bytes": 3, "k": "x"}
    merged = merge_stats([{"engine/steps": 3, "engine/prefix_hit_rate": 0.5, "engine/state": "running", "x": 1,
                           "engine/generated_tokens": 5},
                          {"engine/steps": 4, "engine/prefix_hit_rate": 0.25, "engine/state": "paused",
                           "engine/generated_tokens": 6}])
    # NOTE: "generated_tokens" holds the letters of "rate": a count all the same, summed
    assert merged == {"steps": 7, "prefix_hit_rate": 0.375, "state": "mixed", "generated_tokens": 11}


def test_replica_verdicts_by_the_clock():
    ctx = zmq.Context()
    link = ReplicaLink("r0", "tcp://127.0.0.1:9", ctx, HealthConfig(every_s=0.1, dead_after_s=1.0,
                                                                    stall_deadline_s=2.0), now=100.0)
    try:
        assert link.verdict(100.5) is None and not link.looks_healthy(100.5)  # joining, not heard yet
        link.on_health(HealthInfo(healthy=True, seconds_since_loop_tick=0.01, state="running", policy_version=3),
                       100.6)
        assert link.looks_healthy(100.7) and link.version == 3
        assert "silent" in link.verdict(101.7)  # a dead process answers nothing
        link.on_health(HealthInfo(healthy=False, seconds_since_loop_tick=2.5, state="running", policy_version=3),
                       101.8)
        assert "stalled" in link.verdict(101.9)  # a wedged loop: the server still answers Health
        link.take_out("stalled", 102.0)
        assert not link.looks_healthy(102.1)  # only a reply after the take-out brings it back
        link.on_health(HealthInfo(healthy=True, seconds_since_loop_tick=0.0, state="paused", policy_version=3), 102.2)
        assert link.looks_healthy(102.3)
    finally:
        link.close()
        ctx.term()


def test_staleness_spans_and_prompt_hashes():
    assert not too_stale(np.array([1, 1, 2], np.int32), None) and not too_stale(np.array([1, 2], np.int32), 1)
    assert too_stale(np.array([1, 2], np.int32), 0) and not too_stale(np.array([], np.int32), 0)
    prompt = np.arange(3, 13, dtype=np.int32)  # 10 tokens: the blocks before the last token, as the engine
    assert Route().prompt_hashes(prompt, 4, 2) == block_hashes(list(range(3, 11)), 4, extra_key=2)


# ---- a router with no replica up -----------------------------------------------------------------


def test_router_without_replicas_holds_requests_and_aborts_them():
    with RolloutRouter([], RouterConfig()) as router, RolloutClient(router.address, timeout=30) as c:
        assert not c.health().healthy
        stream = c.stream([[5, 6, 7]], n=2, sampling=greedy(4))
        stats = c.stats()
        assert stats["queue_depth"] == 2 and stats["replicas"] == 0 and stats["requests_in_flight"] == 1
        stream.abort()  # held: its samples end at once, empty
        rollouts = stream.result(10)
        assert [r.finish_reason for r in rollouts] == [FinishReason.ABORT] * 2 and not rollouts[0].completion_ids
        with pytest.raises(ProtocolError) as info:
            c.pause("keep")
        assert info.value.code is ErrorCode.ENGINE_STATE and "no replica" in info.value.message
        with pytest.raises(ProtocolError, match="prefix cache"):
            c._call(KvEvents(request_id="k-1"), None)


def test_a_group_never_spans_two_versions():
    with RolloutRouter([], RouterConfig()) as router, RolloutClient(router.address, timeout=30) as c:
        replicas = router.replica_set
        router._ask(lambda: (replicas.placement.add("gone"), replicas.placement.assign(
            "gone", Reason.LEAST_LOADED, 0, group_id="grp", version=0), setattr(replicas.fleet, "version", 1)))
        with pytest.raises(ProtocolError, match="never mixes versions") as info:
            c.generate([[5, 6]], 1, greedy(2), group_id="grp")
        assert info.value.code is ErrorCode.ENGINE_STATE


def test_router_config_names_the_field():
    with pytest.raises(ValueError, match="max_staleness"):
        RouterConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="dead_after_s"):
        HealthConfig(every_s=1.0, dead_after_s=0.5)
    with pytest.raises(ValueError, match="load_imbalance"):
        PlacementConfig(load_imbalance=0.5)


class _Sink:
    def __init__(self) -> None:
        self.delivered: list = []
        self.tokens: list = []

    def deliver(self, record, out, now) -> None:
        self.delivered.append(out)

    def forward_tokens(self, record, delta) -> None:
        self.tokens.append((delta.sample_index, delta.token_ids.tolist()))

    def refused(self, record, reply) -> None: ...

    def control_done(self, fan) -> None: ...


class _Unwatched:
    """The endpoint's `watch` side, for replica sets whose sockets nobody reads here."""

    def watch(self, socket, on_readable) -> None: ...

    def unwatch(self, socket) -> None: ...


@pytest.mark.parametrize("policy", ["recompute", "abort"])
def test_a_finished_sample_spanning_too_many_versions(policy):
    ctx = zmq.Context()
    sink = _Sink()
    replicas = ReplicaSet(ctx, _Unwatched(), sink, ServiceMetrics(), Placement(), HealthConfig(), max_staleness=0,
                          stale_policy=policy)
    record = Record("c-1", Generate(request_id="c-1", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(n=2)),
                    b"p", 2)
    record.stream = Route()
    replicas.placement.add("r0")
    attempt = Attempt("a-1", record, "r0", [0, 1], version=0, prompt_cost=3, sample_cost=16)
    replicas.attempts[attempt.id] = record.stream.attempts[attempt.id] = attempt

    def sample(index: int, versions: list[int]) -> SampleOutput:
        return SampleOutput(request_id="a-1", sample_index=index, n=2, prompt_len=3, token_ids=[4] * len(versions),
                            logprobs=[0.0] * len(versions), versions=versions, finish_reason=FinishReason.LENGTH)

    try:
        replicas._attempt_reply(attempt, sample(0, [0, 0, 1]), now=0.0)  # spans two versions: too stale for 0
        replicas._attempt_reply(attempt, sample(1, [1, 1]), now=0.0)
    finally:
        ctx.term()
    if policy == "recompute":  # sampled again under the current version (held here: no replica up)
        assert [(o.sample_index, o.finish_reason) for o in sink.delivered] == [(1, FinishReason.LENGTH)]
        assert [(r.request_id, indices) for r, indices in replicas.held] == [("c-1", [0])]
    else:  # finished now as aborted, with the tokens it has
        assert [(o.sample_index, o.finish_reason, o.versions.tolist()) for o in sink.delivered] == [
            (0, FinishReason.ABORT, [0, 0, 1]), (1, FinishReason.LENGTH, [1, 1])]
    assert replicas.placement.load["r0"] == 0 and not replicas.attempts  # its load went with it


def _take_frames(link: ReplicaLink) -> list:
    frames = [decode_request(f) for f in link._backlog]  # NOTE: what it was sent, held (nothing listens)
    link._backlog.clear()
    return frames


@pytest.mark.parametrize("seed", [None, 1234])
def test_owed_samples_of_a_seeded_request_keep_their_indices(seed):
    """Failover / recompute of samples 2 and 3 of n=4: a seeded request must not send them as a
    Generate of n=2 (its samples would replay the streams of 0 and 1), so it is sent whole and
    the copies of 0 and 1 are dropped (and stopped once 2 and 3 are back); an unseeded one sends
    just what is owed."""
    ctx = zmq.Context()
    sink = _Sink()
    replicas = ReplicaSet(ctx, _Unwatched(), sink, ServiceMetrics(), Placement(), HealthConfig())
    record = Record("c-1", Generate(request_id="c-1", prompt_token_ids=[1, 2, 3],
                                    sampling=SamplingParams(n=4, seed=seed)), b"p", 4)
    record.stream = Route()
    name = replicas.add("tcp://127.0.0.1:9")  # nothing listens there: what it is sent stays in its backlog
    link = replicas.links[name]
    link.state, link.version, link.block_size, replicas.fleet.version = ReplicaState.UP, 0, 4, 0

    def sample(attempt_id: str, index: int, n: int) -> SampleOutput:
        return SampleOutput(request_id=attempt_id, sample_index=index, n=n, prompt_len=3, token_ids=[4 + index],
                            logprobs=[0.0], versions=[0], finish_reason=FinishReason.LENGTH)

    try:
        replicas.dispatch(record, [2, 3], now=0.0)
        (sent,) = _take_frames(link)
        (attempt,) = replicas.attempts.values()
        assert isinstance(sent, Generate) and sent.request_id == attempt.id and sent.sampling.seed == seed
        owed_here = [0, 1] if seed is None else [2, 3]  # the attempt's own indices of samples 2 and 3
        assert sent.sampling.n == (2 if seed is None else 4)
        replicas._attempt_reply(attempt, TokenDelta(request_id=attempt.id, sample_index=0, start=0, token_ids=[9],
                                                    logprobs=[0.0], versions=[0]), now=0.0)
        for j in owed_here:
            replicas._attempt_reply(attempt, sample(attempt.id, j, sent.sampling.n), now=0.0)
        assert [o.sample_index for o in sink.delivered] == [2, 3]  # each once, under its own index
        assert [o.token_ids.tolist() for o in sink.delivered] == [[4 + j] for j in owed_here]
        assert sink.tokens == ([(2, [9])] if seed is None else [])  # a sample run for nobody streams nothing
        assert not replicas.attempts and replicas.placement.load[name] == 0
        stopped = _take_frames(link)  # the samples nobody waits for are stopped
        assert stopped == ([] if seed is None else [Abort(request_id=stopped[0].request_id, targets=[attempt.id])])
    finally:
        link.close()
        ctx.term()
