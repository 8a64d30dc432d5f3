"""The service's parts alone: leases, the exactly-once registry, the mailbox, metrics, reply dedup."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from inference import SamplingParams
from rollout.client.streams import GeneratePending
from rollout.service.leases import Leases
from rollout.service.metrics import SERVICE_KEYS, ServiceMetrics
from rollout.service.registry import RequestRegistry
from rollout.wire.codec import decode_reply, encode
from rollout.wire.kinds import ErrorCode, Kind
from rollout.wire.mailbox import Mailbox
from rollout.wire.messages import ErrorReply, Generate, Result, SampleOutput, TokenDelta

PEERS = [b"a", b"b", b"c"]

# ---- leases ------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["renew", "beat", "tick"]), st.sampled_from(PEERS),
                          st.floats(0.0, 3.0), st.floats(0.1, 5.0)), max_size=60))
def test_leases_expire_exactly_the_silent_peers_once(ops):
    leases, model, now = Leases(default_s=1.0, max_s=3.0), {}, 0.0  # model: peer -> (deadline, length)
    for op, peer, dt, length in ops:
        now += dt
        if op == "tick":
            got = sorted(leases.expired(now))
            want = sorted(p for p, (d, _) in model.items() if d <= now)
            assert got == want
            for p in want:
                del model[p]
            continue
        own = min(length, 3.0) if op == "beat" else model.get(peer, (0, 1.0))[1]  # a new peer: the default
        leases.renew(peer, now, length if op == "beat" else None)
        model[peer] = (now + own, own)
    assert sorted(leases.expired(1e9)) == sorted(model)
    assert len(leases) == 0


def test_a_lease_asked_beyond_the_cap_is_cut_to_it():
    leases = Leases(default_s=2.0, max_s=5.0)
    assert leases.renew(b"x", 0.0, lease_s=3600.0)  # cut (worth a log) ...
    assert not leases.renew(b"x", 1.0, lease_s=3600.0)  # ... once per peer
    assert not leases.renew(b"y", 0.0, lease_s=4.0)
    assert leases.expired(5.9) == [b"y"] and leases.expired(6.0) == [b"x"]  # x: 1.0 + 5.0, not an hour
    with pytest.raises(ValueError, match="max_s"):
        Leases(default_s=2.0, max_s=1.0)


def test_a_forgotten_peer_starts_from_the_default_lease():
    leases = Leases(default_s=2.0)
    leases.renew(b"x", 0.0, lease_s=0.5)
    assert leases.expired(0.5) == [b"x"] and not leases.is_live(b"x")
    leases.renew(b"x", 1.0)
    assert leases.expired(2.9) == [] and leases.expired(3.0) == [b"x"]
    with pytest.raises(ValueError, match="default_s"):
        Leases(0)


# ---- the exactly-once registry -----------------------------------------------------------------


def generate(rid: str, n: int = 2) -> Generate:
    return Generate(request_id=rid, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(n=n))


class RegistryMachine(RuleBasedStateMachine):
    """The registry against a dict model: owners of unfinished records, retention, purge."""

    def __init__(self) -> None:
        super().__init__()
        self.reg = RequestRegistry(retain_s=10.0)
        self.model: dict[str, dict] = {}
        self.now = 0.0

    @rule(i=st.integers(0, 7), owner=st.sampled_from(PEERS), n=st.integers(1, 3))
    def add(self, i, owner, n):
        rid = f"r{i}"
        if rid in self.model:
            return
        self.reg.add(generate(rid, n), owner)
        self.model[rid] = {"owner": owner, "n": n, "done": set(), "at": None}

    @rule(i=st.integers(0, 7), owner=st.sampled_from(PEERS))
    def move(self, i, owner):
        rec = self.reg.get(f"r{i}")
        if rec is not None:
            self.reg.move(rec, owner)
            self.model[f"r{i}"]["owner"] = owner

    @rule(i=st.integers(0, 7), k=st.integers(0, 2))
    def finish(self, i, k):
        rid = f"r{i}"
        rec = self.reg.get(rid)
        if rec is None or k >= rec.n:
            return
        new = self.reg.finish_sample(rec, k, b"frame", self.now)
        m = self.model[rid]
        assert new == (k not in m["done"])
        m["done"].add(k)
        if len(m["done"]) == m["n"] and m["at"] is None:
            m["at"] = self.now

    @rule(dt=st.floats(0, 8))
    def purge(self, dt):
        self.now += dt
        self.reg.purge(self.now)
        for rid in [r for r, m in self.model.items() if m["at"] is not None and m["at"] <= self.now - 10.0]:
            del self.model[rid]

    @rule(i=st.integers(0, 7))
    def drop_unfinished(self, i):
        rec = self.reg.get(f"r{i}")
        if rec is not None and not rec.done:
            self.reg.drop(rec)
            del self.model[f"r{i}"]

    @invariant()
    def agrees(self):
        assert len(self.reg) == len(self.model)
        for owner in PEERS:
            live = {r.request_id for r in self.reg.live_of(owner)}
            assert live == {rid for rid, m in self.model.items() if m["owner"] == owner and len(m["done"]) < m["n"]}
        assert self.reg.num_live == sum(len(m["done"]) < m["n"] for m in self.model.values())


TestRegistry = RegistryMachine.TestCase
TestRegistry.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


def test_registry_keeps_finished_requests_for_replay_then_forgets_them():
    reg = RequestRegistry(retain_s=5.0, max_retained=2)
    recs = [reg.add(generate(f"g{i}", n=1), b"p") for i in range(3)]
    for i, rec in enumerate(recs):
        assert reg.finish_sample(rec, 0, f"f{i}".encode(), now=float(i)) and rec.done
    assert reg.purge(2.0) == 1 and "g0" not in reg  # over max_retained: oldest first
    assert reg.get("g1").frames == {0: b"f1"}
    assert reg.purge(6.9) == 1 and reg.purge(7.0) == 1 and len(reg) == 0
    reg.add(generate("x"), b"p")
    with pytest.raises(KeyError):
        reg.add(generate("x"), b"q")


# ---- the mailbox -------------------------------------------------------------------------------


def test_mailbox_loses_no_item_and_no_wake_up():
    box, producers, per = Mailbox(), 4, 5000
    poller = zmq.Poller()
    poller.register(box.fileno(), zmq.POLLIN)

    def produce(k: int) -> None:
        for i in range(per):
            box.put((k, i))

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(producers)]
    for t in threads:
        t.start()
    got: list = []
    deadline = time.monotonic() + 30
    while len(got) < producers * per:
        assert time.monotonic() < deadline, f"{len(got)} items after 30 s"
        if poller.poll(1000):  # NOTE: a lost wake-up would stall here (and fail the deadline)
            got += box.drain()
    for t in threads:
        t.join()
    assert not poller.poll(0) or box.drain() == []
    for k in range(producers):
        assert [i for kk, i in got if kk == k] == list(range(per))  # each producer's order kept
    box.close()


class _PutWhileReading:
    """The mailbox's wake-up socket, with another producer's `put` landing on the first read: the
    interleaving (a put while `drain` consumes the wake-ups) that threads hit only by chance."""

    def __init__(self, box: Mailbox, item) -> None:
        self.box, self.item, self.sock, self.fired = box, item, box._reader, False

    def recv(self, size: int) -> bytes:
        if not self.fired:
            self.fired = True
            self.box.put(self.item)
        return self.sock.recv(size)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_mailbox_keeps_its_wake_up_when_a_put_lands_during_drain():
    box = Mailbox()
    poller = zmq.Poller()
    poller.register(box.fileno(), zmq.POLLIN)
    box.put("first")
    box._reader = _PutWhileReading(box, "during")
    assert box.drain() == ["first", "during"]
    box._reader = box._reader.sock
    box.put("after")  # NOTE: this put must make the descriptor readable, or its owner sleeps a whole poll
    assert poller.poll(0), "an item is pending but the mailbox's descriptor is not readable"
    assert box.drain() == ["after"]
    box.close()


# ---- metrics and reply dedup -------------------------------------------------------------------


def test_metrics_snapshot_is_wire_ready_with_the_headline_keys():
    clock = [100.0]
    metrics = ServiceMetrics(window_s=10.0, clock=lambda: clock[0])
    clock[0] += 20.0
    metrics.sample_sent(np.array([0, 0, 1], dtype="<i4"))
    metrics.count("pauses")
    metrics.error(ErrorCode.MALFORMED)
    engine = {"waiting": 3, "preemptions": 2, "prefix_hit_rate": 0.5, "kv_utilization": 0.25, "policy_version": 1,
              "pause_mode": None, "prefix_caching": True, "state": "running"}
    snap = metrics.snapshot(engine, held=2, requests_in_flight=4)
    assert set(SERVICE_KEYS) <= set(snap)
    assert (snap["queue_depth"], snap["evictions"], snap["pauses"], snap["kv_utilization"]) == (5, 2, 1, 0.25)
    assert (snap["tokens_v0"], snap["tokens_v1"], snap["errors/MALFORMED"]) == (2, 1, 1)
    assert snap["tokens_per_s"] == pytest.approx(3 / 10.0) and "engine/pause_mode" not in snap
    assert snap["engine/prefix_caching"] == 1
    back = decode_reply(encode(Result(request_id="s", request_kind=Kind.STATS, stats=snap)))
    assert back.stats == snap
    clock[0] += 11.0
    assert metrics.tokens_per_s() == 0.0


def test_a_generate_pending_keeps_the_first_copy_of_each_sample_and_token():
    got: list = []
    pending = GeneratePending(group=3, n=2, sink=got.append)

    def sample(i):
        return SampleOutput(request_id="g", sample_index=i, n=2, prompt_len=1, token_ids=[5, 6], logprobs=[0.0, 0.0],
                            versions=[0, 0], finish_reason="length")

    def delta(start, tokens):
        return TokenDelta(request_id="g", sample_index=0, start=start, token_ids=tokens, logprobs=[0.0] * len(tokens),
                          versions=[0] * len(tokens))

    assert not pending.on_reply(delta(0, [5]))
    assert not pending.on_reply(delta(0, [5, 6]))  # a replay overlapping what came: only token 6 is new
    assert not pending.on_reply(delta(0, [5]))  # nothing new
    assert not pending.on_reply(sample(0))
    assert not pending.on_reply(sample(0))  # a replayed sample after a reconnect
    assert pending.on_reply(sample(1))
    assert [g for g, _ in got] == [3] * 4
    assert [p[1] for _, p in got[:2]] == [0, 1] and [p.sample_index for _, p in got[2:]] == [0, 1]
    err: list = []
    GeneratePending(0, 1, err.append).on_reply(ErrorReply(code=ErrorCode.DUPLICATE, message="m", request_id="g"))
    assert err[0][1].code is ErrorCode.DUPLICATE
