"""`generate()` aborts its own unfinished requests when waiting fails (a timeout, an interrupt,
a failed step) and leaves other callers' requests alone. The check is run once more against a
planted bug and must catch it."""

from __future__ import annotations

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from tests.inference.engine.conftest import random_prompts, tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def engine_for() -> DynamicInferenceEngine:
    return DynamicInferenceEngine.from_pretrained(tiny_llama(seed=16), InferenceConfig(
        block_size=4, num_blocks=128, max_requests=8, max_batch_tokens=64, max_sequence_length=64))


def fail_on_step(engine, monkeypatch, error, after):
    """The engine's `after`-th step from now raises `error` (then steps work again)."""
    step, calls = engine.core.step, []

    def failing():
        calls.append(1)
        if len(calls) == after:
            raise error
        step()

    monkeypatch.setattr(engine.core, "step", failing)


FAILURES = {
    "timeout": lambda engine, monkeypatch: {"timeout": 0.0},
    "interrupt": lambda engine, monkeypatch: fail_on_step(engine, monkeypatch, KeyboardInterrupt(), 3),
    "failed step": lambda engine, monkeypatch: fail_on_step(engine, monkeypatch, RuntimeError("device lost"), 3),
}


def check_generate_aborts_its_own(failure, monkeypatch):
    engine = engine_for()
    other = engine.add_request([5, 6, 7, 8], LONG)  # another caller's, driven by step()
    engine.step()
    kwargs = FAILURES[failure](engine, monkeypatch) or {}
    with pytest.raises((TimeoutError, KeyboardInterrupt, RuntimeError)):
        engine.generate(random_prompts(3, 5, 9, seed=101), SamplingParams(n=2, temperature=1.0, max_tokens=40,
                                                                          ignore_eos=True), **kwargs)
    live = set(engine.scheduler.live)
    assert live == {other}, f"generate left its requests {sorted(live - {other})} in the engine"
    held = engine.allocator.active
    assert held == engine.context.num_blocks[engine.context.active].sum(), "blocks leaked"
    monkeypatch.undo()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == [other] and len(outputs[0].generated_token_ids) == 40
    assert engine.allocator.active == 0


@pytest.mark.parametrize("failure", list(FAILURES))
def test_generate_aborts_its_requests_when_waiting_fails(failure, monkeypatch):
    check_generate_aborts_its_own(failure, monkeypatch)


@pytest.fixture
def planted_generate_leaves_its_requests(monkeypatch):
    """Planted bug: generate does not abort what it submitted when it gives up."""
    monkeypatch.setattr(DynamicInferenceEngine, "abort_many", lambda self, request_ids: 0)


@pytest.mark.parametrize("failure", list(FAILURES))
def test_the_check_catches_requests_left_behind(failure, monkeypatch, planted_generate_leaves_its_requests):
    with pytest.raises(AssertionError, match="left its requests"):
        check_generate_aborts_its_own(failure, monkeypatch)
