"""Groups, bad input, abort and the typed overflow errors of the engine."""

from __future__ import annotations

import math

import pytest

from inference import (
    BlockOverflowError,
    DynamicInferenceEngine,
    InferenceConfig,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    SamplingParams,
)
from tests.inference.engine.conftest import VOCAB, hf_greedy, random_prompts


def small_engine(model, **overrides) -> DynamicInferenceEngine:
    fields = dict(block_size=4, num_blocks=64, max_requests=16, max_batch_tokens=64, chunked_prefill_size=16,
                  max_sequence_length=96)
    fields.update(overrides)
    return DynamicInferenceEngine.from_pretrained(model, InferenceConfig(**fields))


@pytest.mark.parametrize("prompt_len", [13, 16])  # a partial last block, and only full blocks
def test_group_of_eight_prefills_its_prompt_once(llama, prompt_len):
    engine = small_engine(llama, chunked_prefill_size=5)
    prompts = random_prompts(3, prompt_len, prompt_len, seed=7)
    outputs = engine.generate(prompts, SamplingParams(n=8, temperature=1.0, max_tokens=10, ignore_eos=True))
    assert len(outputs) == 24
    assert engine.context.prefill_tokens == 3 * prompt_len
    for g, prompt in enumerate(prompts):
        group = outputs[8 * g : 8 * g + 8]
        assert [o.sample_index for o in group] == list(range(8))
        assert all(o.prompt_token_ids == prompt and len(o.generated_token_ids) == 10 for o in group)
        assert len({tuple(o.generated_token_ids) for o in group}) > 1  # samples diverge


def test_greedy_group_samples_equal_hf(llama):
    engine = small_engine(llama)
    prompt = random_prompts(1, 11, 11, seed=8)[0]
    outputs = engine.generate([prompt], SamplingParams(n=4, temperature=0, max_tokens=12, ignore_eos=True))
    expected = hf_greedy(llama, prompt, 12)
    assert all(o.generated_token_ids == expected for o in outputs)


def test_stop_token_and_eos_finish_with_reason_stop(llama):
    engine = small_engine(llama)
    prompt = random_prompts(1, 9, 9, seed=9)[0]
    free_run = hf_greedy(llama, prompt, 12)
    stop_at = free_run[5]
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at],
                                                      ignore_eos=True))
    assert out.finish_reason.value == "stop"
    assert out.generated_token_ids == free_run[: free_run.index(stop_at) + 1]


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], SamplingParams(), "prompt_token_ids"),
        ([1, VOCAB], SamplingParams(), "prompt_token_ids"),
        ([1, -1], SamplingParams(), "prompt_token_ids"),
        ("hello", SamplingParams(), "prompt_token_ids"),
        ([1, 2], SamplingParams(stop_token_ids=[VOCAB + 5]), "stop_token_ids"),
    ],
)
def test_bad_input_names_the_field_and_engine_keeps_serving(llama, prompt, params, field):
    engine = small_engine(llama)
    good = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match=field):
        engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == [good]
    assert len(outputs[0].generated_token_ids) == 4


@pytest.mark.parametrize(
    "kwargs, field",
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": math.nan}, "temperature"), ({"top_p": 0.0}, "top_p")],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_permanent_overflows_are_rejected_at_add(llama):
    engine = small_engine(llama, num_blocks=8, max_sequence_length=64)
    with pytest.raises(MaxSequenceLengthOverflowError) as exc:
        engine.add_request(list(range(3, 60)), SamplingParams(max_tokens=10))
    assert not exc.value.is_transient
    with pytest.raises(BlockOverflowError) as exc:
        engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=1))  # 10 blocks > pool of 8
    assert not exc.value.is_transient
    with pytest.raises(RequestOverflowError):
        engine.add_request([3, 4], SamplingParams(n=17))
    assert not engine.has_unfinished_requests()


def test_abort_returns_partial_tokens_and_frees_blocks(llama):
    engine = small_engine(llama)
    keep = engine.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    drop = engine.add_request([9, 8, 7, 6, 5], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.abort(drop)
    assert not engine.abort(drop)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    outputs += engine.step()
    by_id = {o.request_id: o for o in outputs}
    assert by_id[drop].finish_reason.value == "abort" and 0 < len(by_id[drop].generated_token_ids) < 20
    assert len(by_id[keep].generated_token_ids) == 20
    assert engine.allocator.active == 0


def test_abort_of_waiting_group_member_and_leader(llama):
    engine = small_engine(llama)
    ids = engine.add_request([5, 6, 7, 8, 9, 10], SamplingParams(n=3, temperature=1.0, max_tokens=5, ignore_eos=True))
    engine.abort(ids[0])  # the leader, before its prefill: a sibling takes over
    engine.abort(ids[2])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    by_id = {o.request_id: o for o in outputs}
    assert by_id[ids[0]].finish_reason.value == "abort" and by_id[ids[2]].finish_reason.value == "abort"
    assert len(by_id[ids[1]].generated_token_ids) == 5
    assert engine.scheduler.reserved_slots == 0 and engine.allocator.active == 0


def test_identical_prompts_added_together_are_prefilled_once(llama):
    engine = small_engine(llama)
    prompt = random_prompts(1, 16, 16, seed=12)[0]
    outputs = engine.generate([prompt] * 8, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    # the first computes the prompt; the others join its group while it waits for a slot and fork
    # from its prefill (as the samples of one request with n = 8 do)
    assert engine.context.prefill_tokens == 16
    assert len({tuple(o.generated_token_ids) for o in outputs}) == 1


def test_requests_that_join_a_group_keep_their_own_limits_and_tokens(llama):
    engine = small_engine(llama)
    prompt = random_prompts(1, 13, 13, seed=14)[0]  # a partial last block: copied to each fork
    lengths = [3, 7, 1, 5]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
    outputs = engine.generate([prompt] * 4, params)
    assert engine.context.prefill_tokens == 13
    assert [len(o.generated_token_ids) for o in outputs] == lengths  # each its own max_tokens
    want = hf_greedy(llama, prompt, max(lengths))
    assert all(o.generated_token_ids == want[: len(o.generated_token_ids)] for o in outputs)
    assert engine.scheduler.reserved_slots == 0 and engine.allocator.active == 0


def test_only_requests_that_may_share_a_prefill_join_one(llama):
    engine = small_engine(llama, max_requests=8)
    core = engine.core
    prompt = random_prompts(1, 13, 13, seed=15)[0]
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    core.add_checked(prompt, greedy)
    core.add_checked(prompt, greedy, client="other")  # another client's turn: never a fork of this one
    core.add_checked(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, cache_salt="s"))
    core.add_checked(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1))
    core.add_checked(prompt, SamplingParams(temperature=0.5, max_tokens=2, ignore_eos=True, seed=3))  # joins
    waiting = list(core.scheduler.waiting)
    assert len(waiting) == 4 and [len(r.fork_children) for r in waiting] == [1, 0, 0, 0]
    for _ in range(5):  # groups of at most max_requests / 2 = 4: the third leads a group of its own
        core.add_checked(prompt, greedy)
    # the shared lane (4 leaders), then the other client's
    assert [len(r.fork_children) for r in core.scheduler.waiting] == [3, 0, 0, 2, 0]
    engine.step()
    (rid,) = core.add_checked(prompt, greedy)
    slotted = [r for r in engine.context.requests if r is not None]
    assert slotted and all(rid not in {c.request_id for c in r.fork_children} for r in slotted)  # none joins them
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.reserved_slots == 0 and engine.allocator.active == 0


def test_a_joined_group_outlives_its_aborted_leader(llama):
    engine = small_engine(llama)
    prompt = random_prompts(1, 13, 13, seed=16)[0]
    ids = [engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)) for _ in range(3)]
    engine.abort(ids[0])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    by_id = {o.request_id: o for o in outputs}
    assert by_id[ids[0]].finish_reason.value == "abort"
    assert by_id[ids[1]].generated_token_ids == by_id[ids[2]].generated_token_ids == hf_greedy(llama, prompt, 4)
    assert engine.context.prefill_tokens == 13  # the second took the group and prefilled for both
    assert engine.scheduler.reserved_slots == 0 and engine.allocator.active == 0
