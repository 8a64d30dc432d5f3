"""Waiting on a posted call without a background loop (`engine.settle`, `engine.when`): the
caller steps the engine while a WAIT pause drains, a condition registered before the loop starts
is handed to it, and a bounded wait that cannot be met raises instead of hanging."""

from __future__ import annotations

import threading

import pytest

from inference import DynamicInferenceEngine, EngineState, InferenceConfig, PauseMode, SamplingParams
from tests.inference.engine.conftest import tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")
WAIT_S = 30.0


def new_engine() -> DynamicInferenceEngine:
    return DynamicInferenceEngine.from_pretrained(tiny_llama(layers=1, hidden=32, seed=2),
                                                  InferenceConfig(block_size=4, num_blocks=64, max_sequence_length=32))


def test_a_wait_pause_posted_without_a_loop_resolves_as_its_caller_steps():
    engine = new_engine()
    stream = engine.submit([1, 5, 6], SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()  # admitted and running
    drained = engine.post_pause(PauseMode.WAIT)
    assert not drained.done()  # nothing steps the engine until someone waits
    engine.settle(drained, WAIT_S)
    assert engine.core.drained() and engine.state is EngineState.PAUSED
    assert [len(o.generated_token_ids) for o in stream.result(timeout=WAIT_S)] == [12, 12]
    engine.continue_()


def test_a_condition_registered_without_a_loop_is_handed_to_the_loop_when_it_starts():
    engine = new_engine()
    flag = threading.Event()
    held = engine.when(flag.is_set)
    assert not held.done()
    engine.start()
    try:
        flag.set()
        held.result(WAIT_S)  # the loop checked it after a round
    finally:
        engine.stop()


def test_a_bounded_settle_that_cannot_be_met_raises():
    engine = new_engine()
    never = engine.when(lambda: False)
    with pytest.raises(TimeoutError):
        engine.settle(never, 0.05)
