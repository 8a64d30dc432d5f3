"""Engines in expert-parallel lockstep over a real ZMQ group, in one process (a dense model: the
lockstep alone, no expert exchange; the MoE exchange across processes: models/parallel/test_ep_engine.py).
A rank without requests runs dummy steps of the agreed bucket and keeps its prefix cache; with
background loops an idle rank heartbeats, serves its peer's steps, and the group stops together."""

from __future__ import annotations

import socket
import threading

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.core.ep_sync import EPCommunicator
from tests.inference.engine.conftest import random_prompts, tiny_llama

BUCKETS = dict(batch_buckets=(8, 16, 32), decode_buckets=(2, 4, 8))
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def config() -> InferenceConfig:
    return InferenceConfig(block_size=4, num_blocks=96, max_requests=8, max_batch_tokens=32, chunked_prefill_size=16,
                           max_sequence_length=64, **BUCKETS)


@pytest.fixture(scope="module")
def hf():
    return tiny_llama(layers=2, hidden=64, seed=3)


@pytest.fixture
def group(hf):
    """Two engines whose steps agree over a real 2-rank ZMQ group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    engines = [DynamicInferenceEngine.from_pretrained(hf, config()) for _ in range(2)]
    comms: list = [None, None]
    _lockstep(engines, lambda e: comms.__setitem__(engines.index(e), EPCommunicator(
        engines.index(e), 2, address, timeout_s=10.0)))
    for engine, comm in zip(engines, comms):
        engine.set_ep_communicator(comm)
    yield engines
    for engine in engines:
        engine.stop()
    for c in comms:
        c.close()


def _lockstep(engines, work):
    """Run each engine's `work(engine)` on its own thread; re-raise the first failure."""
    errors = []

    def run(engine):
        try:
            work(engine)
        except BaseException as exc:  # noqa: BLE001 (re-raised on the test thread)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


def test_an_idle_rank_runs_dummy_steps_in_lockstep_and_keeps_its_prefix_cache(hf, group):
    engines, params = group, PARAMS
    shared = random_prompts(1, 17, 17, seed=8)[0]
    busy, idle = engines
    idle.add_request(shared, params)  # fills the idle rank's prefix cache first
    _lockstep(engines, lambda e: e.step_until_ep_idle())
    cached = idle.allocator.stats().cached
    assert cached >= 4
    prompts = random_prompts(6, 3, 30, seed=9)
    ids = [busy.add_request(p, params) for p in prompts]
    outputs: dict = {}
    _lockstep(engines, lambda e: outputs.update({o.request_id: o for o in e.step_until_ep_idle()}))
    want = DynamicInferenceEngine.from_pretrained(hf, config()).generate(prompts, params)
    assert [outputs[i].generated_token_ids for i in ids] == [o.generated_token_ids for o in want]
    # every step one rank ran for its requests, the other ran as a dummy of the same bucket
    assert idle.core.ep.dummy_steps == busy.num_steps > 0
    assert busy.core.ep.dummy_steps == idle.num_steps > 0
    assert list(idle.core.ep.buckets) == list(busy.core.ep.buckets)
    assert idle.allocator.stats().cached == cached  # dummy steps left the prefix cache alone
    hits = idle.allocator.hit_blocks
    idle.add_request(shared, params)
    _lockstep(engines, lambda e: e.step_until_ep_idle())
    assert idle.allocator.hit_blocks > hits


def test_background_loops_heartbeat_serve_a_peer_and_stop_together(hf, group):
    busy, idle = group
    for engine in group:
        engine.start()
    prompts = random_prompts(5, 3, 30, seed=10)
    got = busy.generate(prompts, PARAMS, timeout=60)  # the idle rank's loop steps along
    want = DynamicInferenceEngine.from_pretrained(hf, config()).generate(prompts, PARAMS)
    assert [o.generated_token_ids for o in got] == [o.generated_token_ids for o in want]
    stats = idle.stats()
    assert stats["ep_dummy_steps"] == busy.num_steps > 0 and idle.num_steps == 0
    busy.stop()  # the group's last round: the idle rank's loop stops stepping too
    idle.stop()  # returns at once (no peer left to wait for)
    assert busy.core.ep.stopped and idle.core.ep.stopped
    # no rank tried a round after the last one (it would have waited for the peer in vain)
    assert busy.core.ep.comm.round == idle.core.ep.comm.round == busy.core.ep.rounds == idle.core.ep.rounds
    assert busy.core.ep.rounds > busy.num_steps  # heartbeats: rounds without a step
