"""Many callers at once: the background loop, streams, commands from other threads, chaos."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
import torch

from inference import (
    DynamicInferenceEngine,
    EngineState,
    EngineStateError,
    EngineStepError,
    InferenceConfig,
    PauseMode,
    RequestOutput,
    SamplingParams,
    SuspendedAddPolicy,
    SuspendPolicy,
    TokenEvent,
)
from tests.inference.engine.conftest import random_prompts, tiny_llama

WAIT_S = 60  # every wait in these tests is bounded


def config(**overrides) -> InferenceConfig:
    fields = dict(block_size=4, num_blocks=160, max_requests=32, max_batch_tokens=64, chunked_prefill_size=16,
                  max_sequence_length=64)
    fields.update(overrides)
    return InferenceConfig(**fields)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(layers=1, hidden=32, seed=5)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """NOTE: with many Python threads on 2 cores, OpenMP's spinning workers starve the callers
    (tens of ms per op); the engine's ops here are far too small to split anyway."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def check_no_leak(engine: DynamicInferenceEngine) -> None:
    pool, ctx = engine.allocator, engine.context
    assert not engine.scheduler.live and not engine.scheduler.waiting
    assert engine.scheduler.reserved_slots == 0
    assert pool.active == 0 and pool.free + pool.cached == pool.total
    assert len(ctx.free_slots) == engine.config.max_requests


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)


# ---- the contract under chaos ------------------------------------------------------------------


def test_thousand_requests_from_eight_threads_with_aborts_pauses_and_suspends(tiny):
    rng = random.Random(0)
    prompts = random_prompts(1000, 2, 24, seed=31)
    params = [greedy(rng.randrange(1, 17), n=rng.choice([1, 1, 1, 2])) for _ in prompts]
    reference = DynamicInferenceEngine.from_pretrained(tiny, config())
    expected = [[o.generated_token_ids for o in s.result(WAIT_S)]
                for s in reference.submit_many(prompts, params)]

    # NOTE: requests that arrive while the trainer has the memory queue (the default refuses them)
    engine = DynamicInferenceEngine.from_pretrained(tiny, config(suspended_add_policy=SuspendedAddPolicy.QUEUE))
    engine.start()
    delivered: list[list] = [[] for _ in range(8)]  # every final output a thread's streams received
    results: dict[int, list[RequestOutput]] = {}
    live_ids: list[int] = []
    id_lock = threading.Lock()
    stop_chaos = threading.Event()
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            mine = list(range(w, len(prompts), 8))
            wrng = random.Random(w)
            streams = {}
            while mine:
                batch = mine[: wrng.randrange(1, 5)]
                mine = mine[len(batch):]
                if len(batch) == 1:
                    got = [engine.submit(prompts[batch[0]], params[batch[0]], stream_tokens=wrng.random() < 0.5,
                                         callback=lambda item, w=w: delivered[w].append(item))]
                else:
                    got = engine.submit_many([prompts[i] for i in batch], [params[i] for i in batch],
                                             callback=lambda item, w=w: delivered[w].append(item))
                for i, stream in zip(batch, got):
                    streams[i] = stream
                    with id_lock:
                        live_ids.extend(stream.request_ids)
                # NOTE: arrivals about as fast as the engine serves them, so the chaos meets a short queue
                time.sleep(0.02 + wrng.random() * 0.02)
            for i, stream in streams.items():
                results[i] = stream.result(WAIT_S)
        except BaseException as exc:  # noqa: BLE001 (re-raised by the test thread)
            errors.append(exc)

    def aborter() -> None:
        crng = random.Random(100)
        while not stop_chaos.wait(0.01):
            with id_lock:
                rid = crng.choice(live_ids) if live_ids else None
            if rid is not None and crng.random() < 0.3:
                engine.abort(rid)

    chaos_log = Counter()

    def disturber() -> None:
        # every pause mode and suspend policy early on, then at random; the all-aborting ones rarely
        crng = random.Random(200)
        gentle = ["wait", "keep", "retract", "recompute", "offload"]
        plan = gentle * 4 + ["abort", "suspend-abort"]
        try:
            while not stop_chaos.wait(0.003):
                action = plan.pop(0) if plan else crng.choice(gentle * 20 + ["abort", "suspend-abort"])
                if action in ("abort", "wait", "keep", "retract"):
                    engine.pause(PauseMode(action), timeout=WAIT_S)
                    time.sleep(0.003)
                    engine.continue_()
                else:
                    policy = {"recompute": SuspendPolicy.RECOMPUTE, "offload": SuspendPolicy.OFFLOAD,
                              "suspend-abort": SuspendPolicy.ABORT}[action]
                    engine.suspend(policy)
                    time.sleep(0.003)
                    engine.resume()
                chaos_log[action] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    chaos = [threading.Thread(target=aborter), threading.Thread(target=disturber)]
    for t in workers + chaos:
        t.start()
    for t in workers:
        t.join(WAIT_S * 4)
    stop_chaos.set()
    for t in chaos:
        t.join(WAIT_S)
    engine.stop()
    assert not errors, errors
    assert not any(t.is_alive() for t in workers + chaos)
    assert all(chaos_log[a] > 0 for a in ("abort", "wait", "keep", "retract", "recompute", "offload")), chaos_log

    assert sorted(results) == list(range(len(prompts)))
    all_ids = Counter()
    aborted = 0
    for w in range(8):
        finals = [item for item in delivered[w] if isinstance(item, RequestOutput)]
        all_ids.update(o.request_id for o in finals)
        mine = {rid for i in range(w, len(prompts), 8) for rid in (o.request_id for o in results[i])}
        assert {o.request_id for o in finals} == mine  # each thread got exactly its own outputs
    assert set(all_ids.values()) == {1}  # and each exactly once
    for i, outs in results.items():
        assert [o.sample_index for o in outs] == list(range(params[i].n))
        for out, want in zip(outs, expected[i]):
            assert out.prompt_token_ids == prompts[i]
            if out.finish_reason.value == "abort":
                aborted += 1
                assert want[: len(out.generated_token_ids)] == out.generated_token_ids
            else:
                assert out.generated_token_ids == want
    # aborts happened, and hundreds of requests ran to their end through every kind of disturbance
    assert aborted > 0 and len(all_ids) - aborted >= 200
    check_no_leak(engine)


def test_six_threads_calling_generate_without_a_loop(tiny):
    # NOTE: greedy tokens compared across batchings: seed 32 had two logits 4.5e-7 apart (float64),
    # 3x their fp32 error (1.5e-7), which another batching may flip; seed 43's closest pair is 1.9e-4 apart
    prompts = random_prompts(60, 3, 20, seed=43)
    expected = [o.generated_token_ids for o in DynamicInferenceEngine.from_pretrained(tiny, config()).generate(
        prompts, greedy(10))]
    engine = DynamicInferenceEngine.from_pretrained(tiny, config())
    got: dict[int, list[list[int]]] = {}

    def call(t: int) -> None:
        got[t] = [o.generated_token_ids for o in engine.generate(prompts[t::6], greedy(10), timeout=WAIT_S)]

    threads = [threading.Thread(target=call, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert all(got[t] == expected[t::6] for t in range(6))
    check_no_leak(engine)


# ---- streams -----------------------------------------------------------------------------------


def test_a_stream_yields_its_first_token_before_the_request_finishes(tiny):
    engine = DynamicInferenceEngine.from_pretrained(tiny, config())
    engine.start()
    try:
        stream = engine.submit([5, 6, 7, 8, 9], greedy(12), stream_tokens=True)
        items = iter(stream.items(timeout=WAIT_S))
        first = next(items)
        assert isinstance(first, TokenEvent) and first.index == 0
        assert not stream.done()  # the request is still generating when its first token arrives
        rest = list(items)
        tokens = [first] + [i for i in rest if isinstance(i, TokenEvent)]
        (final,) = [i for i in rest if isinstance(i, RequestOutput)]
        assert [t.token_id for t in tokens] == final.generated_token_ids
        assert [t.logprob for t in tokens] == final.logprobs  # the same numbers, streamed
        assert rest[-1] is final
    finally:
        engine.stop()


def test_outputs_go_only_to_the_channel_a_request_was_added_with(tiny):
    engine = DynamicInferenceEngine.from_pretrained(tiny, config())
    rid = engine.add_request([5, 6, 7], greedy(6))
    stream = engine.submit([8, 9, 10], greedy(4), stream_tokens=False)
    generated = engine.generate([[11, 12, 13]], greedy(5))  # drives steps: others' outputs stay theirs
    assert [o.prompt_token_ids for o in generated] == [[11, 12, 13]]
    assert [o.prompt_token_ids for o in stream.result(WAIT_S)] == [[8, 9, 10]]
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    outputs += engine.step()
    assert [o.request_id for o in outputs] == [rid]


def test_loop_refuses_step_and_add_request_and_stops_cleanly(tiny):
    engine = DynamicInferenceEngine.from_pretrained(tiny, config())
    engine.start()
    with pytest.raises(EngineStateError, match="submit"):
        engine.add_request([5, 6], greedy(2))
    with pytest.raises(EngineStateError, match="loop"):
        engine.step()
    with pytest.raises(EngineStateError, match="already"):
        engine.start()
    assert engine.seconds_since_loop_tick() < 5
    stream = engine.submit([5, 6, 7], greedy(40))
    engine.pause(PauseMode.KEEP)
    engine.stop()  # the request stays in flight; a waiting caller steps it once continued
    engine.continue_()
    assert len(stream.result(WAIT_S)[0].generated_token_ids) == 40
    check_no_leak(engine)


def test_a_failed_step_fails_its_streams_and_the_engine_keeps_serving(tiny, monkeypatch):
    engine = DynamicInferenceEngine.from_pretrained(tiny, config())
    expected = engine.generate([[7, 8, 9]], greedy(6))[0].generated_token_ids
    real = engine.model.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected forward failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", flaky)
    engine.start()
    try:
        stream = engine.submit([7, 8, 9], greedy(6))
        with pytest.raises(EngineStepError, match="injected"):
            stream.result(WAIT_S)
        assert engine.generate([[7, 8, 9]], greedy(6), timeout=WAIT_S)[0].generated_token_ids == expected
    finally:
        engine.stop()
    check_no_leak(engine)


# ---- pause modes, one by one (no loop: the calling thread steps) --------------------------------


def run_to_end(engine: DynamicInferenceEngine) -> list[RequestOutput]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return sorted(outputs + engine.step(), key=lambda o: o.request_id)


@pytest.mark.parametrize("mode", [PauseMode.KEEP, PauseMode.RETRACT])
def test_keep_and_retract_freeze_then_continue_with_the_same_outputs(tiny, mode):
    prompts = random_prompts(6, 5, 18, seed=33)
    expected = [o.generated_token_ids for o in DynamicInferenceEngine.from_pretrained(tiny, config()).generate(
        prompts, greedy(12))]
    engine = DynamicInferenceEngine.from_pretrained(tiny, config())
    for p in prompts[:4]:
        engine.add_request(p, greedy(12))
    for _ in range(3):
        engine.step()
    engine.pause(mode)
    assert engine.state is EngineState.PAUSED
    held = engine.allocator.active
    assert (held > 0) if mode is PauseMode.KEEP else (held == 0)
    for p in prompts[4:]:
        engine.add_request(p, greedy(12))  # queued while paused
    steps = engine.num_steps
    assert engine.step() == [] and engine.num_steps == steps  # nothing runs
    engine.continue_()
    assert [o.generated_token_ids for o in run_to_end(engine)] == expected
    check_no_leak(engine)


def test_abort_pause_returns_partial_outputs_and_wait_pause_drains(tiny):
    engine = DynamicInferenceEngine.from_pretrained(tiny, config())
    first = [engine.add_request(p, greedy(12)) for p in random_prompts(3, 5, 10, seed=34)]
    for _ in range(4):
        engine.step()
    engine.pause(PauseMode.ABORT)
    aborted = engine.step()
    assert sorted(o.request_id for o in aborted) == first
    assert all(o.finish_reason.value == "abort" and len(o.generated_token_ids) < 12 for o in aborted)
    engine.continue_()

    running = [engine.add_request(p, greedy(12)) for p in random_prompts(3, 5, 10, seed=35)]
    engine.step()
    engine.pause(PauseMode.WAIT, timeout=WAIT_S)  # steps until the admitted ones finished
    late = engine.add_request([9, 9, 9], greedy(3))
    done = engine.step()
    assert sorted(o.request_id for o in done) == running
    assert all(len(o.generated_token_ids) == 12 for o in done)
    assert engine.scheduler.live.keys() == {late}  # queued, not admitted while paused
    engine.continue_()
    assert [o.request_id for o in run_to_end(engine)] == [late]
    check_no_leak(engine)


def test_a_pause_or_continue_while_suspended_holds_once_resumed(tiny):
    """As vLLM's `/pause` and `/resume` of a sleeping engine: accepted asleep, in effect after the
    wake-up; with neither, resume returns to the state suspend left."""
    engine = DynamicInferenceEngine.from_pretrained(tiny, config())
    engine.pause(PauseMode.KEEP)
    engine.suspend()
    engine.resume()
    assert engine.state is EngineState.PAUSED
    engine.suspend()
    engine.continue_()
    assert engine.state is EngineState.SUSPENDED
    engine.resume()
    assert engine.state is EngineState.RUNNING
    engine.suspend()
    engine.pause(PauseMode.KEEP)
    assert engine.state is EngineState.SUSPENDED
    engine.resume()
    assert engine.state is EngineState.PAUSED
    engine.continue_()
    assert engine.state is EngineState.RUNNING
