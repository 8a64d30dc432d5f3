"""Speculative decoding on hybrid (Mamba2 + attention) models: lossless against the same engine
without it, and against HF transformers, with the Mamba state rolled back to the last kept token.

The tiny models tie their output head to the embeddings and scale both up: the input embedding
then dominates the residual stream and the model tends to repeat what it reads, so n-gram
proposals are kept often, while samples at T = 1 still break the runs, so proposals are rejected
too. Every test checks both: kept tokens (none passes by never speculating) and rejected ones
(the state rollback ran on a verify that kept only part of its rows).
"""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, SamplingParams
from inference.sampling.params import LogprobsMode
from tests.inference.engine.conftest import hf_greedy, random_prompts
from tests.inference.engine.test_engine_speculative import SPEC, assert_same, config, interrupted
from tests.inference.models.hybrid.tiny import tiny_hybrid
from tests.reference import float64_copy, max_logprob_error

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# NOTE: the bound for log-probs against a float64 reference of the same tokens
LOGPROB_TOL = 1e-5


def repeating_hybrid(family: str, factor: float) -> torch.nn.Module:
    hf = tiny_hybrid(family, seed=7, tie_word_embeddings=True)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(factor)  # NOTE: tied: the input embeddings too
    return hf


def repetitive(prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt ends `a a a a b c a`: while the model repeats `a`, the longest n-gram match of its
    run of `a` ends the prompt's run and proposes `b c ...`, which it rejects (until its own run is
    as long)."""
    return [p + [p[0]] * 4 + [p[1], p[2], p[0]] for p in prompts]


SEEDED = [
    SamplingParams(temperature=1.0, max_tokens=32, seed=5, n=4, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=32, seed=11, n=3, logprobs=2,
                   logprobs_mode=LogprobsMode.PROCESSED),
]


@pytest.fixture(scope="module")
def bamba():
    return repeating_hybrid("bamba", 6.0)


def assert_speculated_and_rolled_back(engine) -> None:
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_tokens_per_row"] > 1.0, stats
    assert stats["spec_proposed_tokens"] > stats["spec_accepted_tokens"], stats  # some verify rows rejected


def assert_released(engine) -> None:
    assert engine.caches.states.held == 0 and engine.allocator.active == 0


@pytest.mark.parametrize("params", SEEDED, ids=["T1", "T0.8-topk-topp-processed"])
def test_seeded_samples_are_identical_with_speculation_on_and_off_under_preemption(bamba, params):
    prompts = repetitive(random_prompts(4, 3, 20, seed=2))
    plain = DynamicInferenceEngine.from_pretrained(bamba, config(None, num_blocks=32)).generate(prompts, params)
    engine = DynamicInferenceEngine.from_pretrained(bamba, config(SPEC, num_blocks=32))
    assert_same(plain, engine.generate(prompts, params))
    assert_speculated_and_rolled_back(engine)
    assert engine.stats()["preemptions"] > 0  # the pool is small on purpose
    assert_released(engine)


def test_falcon_h1_seeded_samples_are_identical_with_speculation_on_and_off():
    """Falcon-H1's multipliers (in / out, per in_proj section) and its norm-then-gate ride along."""
    hf = repeating_hybrid("falcon_h1", 7.0)
    prompts = repetitive(random_prompts(4, 3, 20, seed=2))
    params = SEEDED[0]
    plain = DynamicInferenceEngine.from_pretrained(hf, config(None)).generate(prompts, params)
    engine = DynamicInferenceEngine.from_pretrained(hf, config(SPEC))
    assert_same(plain, engine.generate(prompts, params))
    assert_speculated_and_rolled_back(engine)


def test_greedy_matches_hf_and_logprobs_the_float64_reference_with_pauses_and_chunked_prefill(bamba):
    prompts = repetitive(random_prompts(8, 3, 30, seed=1))
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine = DynamicInferenceEngine.from_pretrained(bamba, config(SPEC, num_blocks=40, max_batch_tokens=48,
                                                                  chunked_prefill_size=12, max_sequence_length=64))
    outputs = engine.generate(prompts, params)
    assert sum(o.num_preemptions for o in outputs) > 0
    for prompt, out in zip(prompts, outputs):
        assert out.generated_token_ids == hf_greedy(bamba, prompt, 20)
    assert max_logprob_error(float64_copy(bamba), outputs) < LOGPROB_TOL
    assert_speculated_and_rolled_back(engine)
    assert_released(engine)


def test_sampled_logprobs_are_the_float64_targets_for_the_tokens_kept(bamba):
    prompts = repetitive(random_prompts(4, 3, 20, seed=3))
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3, n=2, ignore_eos=True,
                            logprobs_mode=LogprobsMode.RAW)
    engine = DynamicInferenceEngine.from_pretrained(bamba, config(SPEC))
    outputs = engine.generate(prompts, params)
    assert_speculated_and_rolled_back(engine)
    assert max_logprob_error(float64_copy(bamba), outputs) < LOGPROB_TOL


def test_prefix_cache_restores_mamba_state_and_history_drafts_the_next_epoch(bamba):
    prompts = repetitive(random_prompts(4, 9, 20, seed=4))
    engine = DynamicInferenceEngine.from_pretrained(bamba, config(SPEC, num_blocks=256))
    plain = DynamicInferenceEngine.from_pretrained(bamba, config(None, num_blocks=256))
    for epoch in range(2):  # NOTE: the second epoch hits the first's prompt states and drafts from its samples
        params = SamplingParams(temperature=1.0, max_tokens=40, seed=epoch, n=3, ignore_eos=True)
        assert_same(plain.generate(prompts, params), engine.generate(prompts, params))
    stats = engine.stats()
    assert stats["state_prefix_hits"] > 0 and stats["spec_history_prompts"] == len(prompts)
    assert_speculated_and_rolled_back(engine)
    assert_released(engine)


def test_suspend_and_pause_mid_generation_change_nothing(bamba):
    prompts = repetitive(random_prompts(3, 3, 20, seed=5))
    params = SamplingParams(temperature=1.0, max_tokens=50, seed=9, n=3, ignore_eos=True)
    plain = DynamicInferenceEngine.from_pretrained(bamba, config(None)).generate(prompts, params)
    engine = DynamicInferenceEngine.from_pretrained(bamba, config(SPEC))
    assert_same(plain, interrupted(engine, prompts, params))
    assert_speculated_and_rolled_back(engine)
    assert_released(engine)
