"""Admission under load: clients take turns (a huge request of one does not hold another's small one
behind all its samples), one request's samples and the waiting queue are bounded (refused as
invalid / overloaded, the engine serving on), and `stats()` shows the bounds and the queue."""

from __future__ import annotations

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, OverloadedError, RequestOutput, SamplingParams
from tests.inference.engine.conftest import hf_greedy, tiny_llama

A_PROMPTS, A_N, A_TOKENS = 8, 4, 12  # client a: 8 groups of 4 samples, each group fills every slot
B_TOKENS = 2


def engine_of(model=None, **bounds) -> DynamicInferenceEngine:
    return DynamicInferenceEngine.from_pretrained(
        model if model is not None else tiny_llama(layers=1, hidden=32, seed=3),
        InferenceConfig(block_size=4, num_blocks=256, max_requests=4, max_batch_tokens=64, max_sequence_length=64,
                        **bounds))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)


def steps_until(engine: DynamicInferenceEngine, done, limit: int = 500) -> int:
    """Steps (driven here, no loop) until `done()`; fails past `limit`."""
    for steps in range(1, limit + 1):
        engine.step()
        if done():
            return steps
    raise AssertionError(f"not done within {limit} steps")


def test_a_small_request_is_not_held_behind_every_sample_of_a_huge_one():
    engine = engine_of()
    prompts = [[3 + i, 40 + i, 7, 9, 11] for i in range(A_PROMPTS)]
    huge = engine.submit_many(prompts, greedy(A_TOKENS, n=A_N), client="a")
    small = engine.submit([5, 6], greedy(B_TOKENS), client="b")
    assert engine.stats()["waiting_clients"] == 2
    steps = steps_until(engine, small.done)
    # NOTE: b waits for one group of a at most (it holds every slot), never for all eight: its
    # turn comes right after a's first one (FIFO: about A_PROMPTS * A_TOKENS steps)
    assert steps <= A_TOKENS + B_TOKENS + 2, steps
    assert not any(s.done() for s in huge[1:])
    steps_until(engine, lambda: all(s.done() for s in huge))
    assert all(len(o.generated_token_ids) == A_TOKENS for s in huge for o in s.result(0))


def finished_into(names: list[str], name: str):
    """A stream callback that records `name` once per finished sample."""
    return lambda item: names.append(name) if isinstance(item, RequestOutput) else None


def test_one_client_is_first_in_first_out_and_greedy_samples_are_hf_s():
    model = tiny_llama(layers=1, hidden=32, seed=3)
    engine = engine_of(model)
    prompts = [[3 + i, 9, 11 + i] for i in range(6)]
    finished: list[str] = []
    streams = [engine.submit(p, greedy(5, n=4), stream_tokens=False, callback=finished_into(finished, str(i)))
               for i, p in enumerate(prompts)]
    steps_until(engine, lambda: len(finished) == 6 * 4)
    assert list(dict.fromkeys(finished)) == [str(i) for i in range(6)]  # one shared lane: oldest first
    for prompt, stream in zip(prompts, streams):
        assert [o.generated_token_ids for o in stream.result(0)] == [hf_greedy(model, prompt, 5)] * 4


def test_clients_take_turns_fifo_within_each():
    engine = engine_of()
    finished: list[str] = []
    for client, k in (("a", 3), ("b", 2), ("c", 1)):
        for i in range(k):
            engine.submit([7, 8 + i], greedy(3, n=4), stream_tokens=False, client=client,
                          callback=finished_into(finished, f"{client}{i}"))
    steps_until(engine, lambda: len(finished) == 6 * 4)
    # NOTE: each group holds all four slots, so groups run one at a time, in the order admitted
    assert list(dict.fromkeys(finished)) == ["a0", "b0", "c0", "a1", "b1", "a2"]


def test_past_the_bounds_a_request_is_refused_and_the_engine_serves_on():
    engine = engine_of(max_samples_per_request=8, max_waiting_samples=10)
    stats = engine.stats()
    assert (stats["max_samples_per_request"], stats["max_waiting_samples"]) == (8, 10)
    with pytest.raises(ValueError, match="max_samples_per_request: the request asks for 12"):
        engine.submit_many([[5, 6], [7, 8], [9, 10]], greedy(4, n=4), client="a")
    assert engine.stats()["waiting_samples"] == 0  # all or nothing
    first = engine.submit_many([[5, 6], [7, 8]], greedy(4, n=4), client="a")  # 8 waiting
    other = engine.submit([9, 10], greedy(4, n=2), client="b")  # 10: the bound
    stats = engine.stats()
    assert (stats["waiting_samples"], stats["waiting_clients"], stats["waiting_samples_largest_client"]) == (10, 2, 8)
    assert engine.waiting_by_client() == {"a": 8, "b": 2}
    with pytest.raises(OverloadedError, match="max_waiting_samples=10") as refused:
        engine.submit([11, 12], greedy(4), client="c")
    assert refused.value.retry_after_s > 0
    out = engine.submit_each([[11, 12], [5, 400]], greedy(4), clients=["c", None])
    assert isinstance(out[0], OverloadedError) and isinstance(out[1], ValueError)  # each refused on its own
    engine.step()  # a's first group takes the slots: 6 samples still wait
    late = engine.submit_many([[13, 14], [15, 16]], greedy(4, n=2), client="c")
    assert engine.stats()["waiting_samples"] == 10
    steps_until(engine, lambda: all(s.done() for s in first + [other] + late))
    stats = engine.stats()
    assert (stats["waiting_samples"], stats["waiting_clients"], stats["waiting"]) == (0, 0, 0)
    assert engine.generate([[5, 6]], greedy(4, n=4))[0].generated_token_ids == first[0].result(0)[0].generated_token_ids


def test_the_bounds_are_checked_when_configured():
    with pytest.raises(ValueError, match="max_waiting_samples"):
        InferenceConfig(max_waiting_samples=0)
    with pytest.raises(ValueError, match="max_samples_per_request .* must be <= max_waiting_samples"):
        InferenceConfig(max_samples_per_request=100, max_waiting_samples=99)
    assert InferenceConfig().max_samples_per_request == 32_768  # one 128 x 256 GRPO batch is taken
    assert InferenceConfig(max_waiting_samples=99).max_samples_per_request == 99
