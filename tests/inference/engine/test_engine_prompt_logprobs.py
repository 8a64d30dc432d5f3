"""Prompt log-probs cached with their KV blocks (the seed's `PromptLogprobsBlock`).

A request asking for prompt log-probs reuses cached blocks and the scores cached with them: its
prompt log-probs equal HF's (computed in float64), as an engine's without a prefix cache do, while
the prefill it saved is counted. It never gets partial data (fewer alternatives than asked, the last slot of a block
scoring another continuation), and nothing cached survives the weights that computed it.
"""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams, SuspendPolicy
from tests.inference.engine.conftest import random_prompts, tiny_llama
from tests.reference import float64_copy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 4


def engine_for(model, **overrides) -> DynamicInferenceEngine:
    fields = dict(block_size=BS, num_blocks=64, max_requests=8, max_batch_tokens=64, chunked_prefill_size=7,
                  max_sequence_length=64)
    fields.update(overrides)
    return DynamicInferenceEngine.from_pretrained(model, InferenceConfig(**fields))


def scored(engine, prompt, top_n, n=1):
    """(the samples' outputs, prefill tokens this call computed, scores it took from the cache)."""
    before = engine.stats()
    outs = engine.generate([prompt], SamplingParams(n=n, temperature=0, max_tokens=2, prompt_logprobs=top_n))
    after = engine.stats()
    return (outs, after["prefill_tokens"] - before["prefill_tokens"],
            after["prompt_logprobs_cached"] - before["prompt_logprobs_cached"])


@torch.no_grad()
def float64_scores(model, prompt, top_n):
    """HF's prompt log-probs computed in float64, as the engine reports them: per position after
    the first, the prompt's token and the top-n alternatives."""
    logp = torch.log_softmax(float64_copy(model)(torch.tensor([prompt])).logits[0], -1)
    scores = [None]
    for t in range(1, len(prompt)):
        top = torch.topk(logp[t - 1], top_n)
        alternatives = dict(zip(top.indices.tolist(), top.values.tolist()))
        scores.append({prompt[t]: logp[t - 1, prompt[t]].item(), **alternatives})
    return scores


# NOTE: |log p| < 7 (384 tokens, tiny logits), where half an fp32 ulp is 2.4e-7: measured max
# |engine - float64 HF| 7.4e-7 (~3 ulps); 5e-6 is 7x. The closest alternatives (n-th vs n+1-th) are
# 6e-5 apart, so the sets of alternatives cannot swap on rounding.
SCORES_TOL = 5e-6


def assert_same_scores(got, want, tol=SCORES_TOL):
    """Same positions, same alternatives, log-probs equal up to fp32 rounding (`want`: float64_scores)."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys()
        assert max(abs(g[k] - w[k]) for k in g) <= tol


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=3)


@pytest.fixture(scope="module")
def prompt():
    return random_prompts(1, 18, 18, seed=41)[0]


def test_a_hit_gives_the_same_prompt_logprobs_and_saves_its_prefill(model, prompt):
    reference = float64_scores(model, prompt, 3)
    engine = engine_for(model)
    (first,), computed, cached = scored(engine, prompt, 3)
    assert computed == 18 and cached == 0
    assert_same_scores(first.prompt_logprobs, reference)
    (second,), computed, cached = scored(engine, prompt, 3)
    # 4 full blocks (16 tokens) before the last token came from the cache with their scores of
    # tokens 1..16; only tokens 16 and 17 were run
    assert computed == 2 and cached == 16
    assert engine.stats()["prefix_cached_tokens"] == 16
    assert second.prompt_logprobs[:17] == first.prompt_logprobs[:17]  # served: the very same numbers
    assert_same_scores(second.prompt_logprobs, reference)
    assert engine.stats()["cross_version_prefix_hits"] == 0


def test_a_shared_prefix_is_served_up_to_the_block_whose_last_slot_scores_another_token(model, prompt):
    engine = engine_for(model)
    scored(engine, prompt, 2)
    other = prompt[:12] + [t + 1 for t in prompt[12:]]  # blocks 0-2 equal, token 12 differs
    (out,), computed, cached = scored(engine, other, 2)
    # block 2's hash matches, but its last slot scores prompt[12], not other[12]: blocks 0-1 only
    assert cached == 8 and computed == 18 - 8
    assert_same_scores(out.prompt_logprobs, float64_scores(model, other, 2))


def test_more_alternatives_than_cached_are_computed_never_served_partially(model, prompt):
    engine = engine_for(model)
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # blocks cached without scores
    (out,), computed, cached = scored(engine, prompt, 2)
    assert cached == 0 and computed == 18  # cached KV without scores does not serve them
    (out,), computed, cached = scored(engine, prompt, 2)
    assert cached == 16
    (out,), computed, cached = scored(engine, prompt, 5)
    assert cached == 0 and computed == 18
    assert_same_scores(out.prompt_logprobs, float64_scores(model, prompt, 5))
    (out,), computed, cached = scored(engine, prompt, 1)  # fewer than cached: served
    assert cached == 16 and computed == 2
    assert_same_scores(out.prompt_logprobs, float64_scores(model, prompt, 1))


def test_samples_of_a_group_and_recomputed_requests_get_the_prompt_logprobs_once(model, prompt):
    engine = engine_for(model)
    outs, computed, _ = scored(engine, prompt, 2, n=3)
    assert computed == 18 and all(o.prompt_logprobs == outs[0].prompt_logprobs for o in outs)
    assert_same_scores(outs[0].prompt_logprobs, float64_scores(model, prompt, 2))
    engine.reset_prefix_cache()
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2))
    engine.step()  # first chunk scored, then recomputed from scratch after the suspend
    engine.suspend(SuspendPolicy.RECOMPUTE)
    engine.resume()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[0].request_id == rid
    assert_same_scores(outputs[0].prompt_logprobs, float64_scores(model, prompt, 2))


def test_scores_are_cached_only_by_a_forward_pass_that_succeeded(model, prompt, monkeypatch):
    engine = engine_for(model)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    engine.step()  # chunk 0..6: block 0 complete and cached with its scores
    assert set(engine.allocator.state.prompt_logprobs) == {int(engine.context.block_table[0, 0])}
    forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda batch: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError):
        engine.step()  # would have completed blocks 1-2
    assert len(engine.allocator.state.prompt_logprobs) == 1 and len(engine.allocator.registry.kv_hash_to_block_id) == 1
    monkeypatch.setattr(engine.runner, "forward", forward)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[0].request_id == rid
    assert_same_scores(outputs[0].prompt_logprobs, float64_scores(model, prompt, 1))


def test_identical_scored_prompts_added_together_compute_the_prompt_once(model, prompt):
    engine = engine_for(model)
    outs = engine.generate([prompt] * 4, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    # the others join the first's group while it waits: they fork from its prefill, scores and all
    assert engine.stats()["prefill_tokens"] == 18 and engine.stats()["prompt_logprobs_cached"] == 0
    assert all(o.prompt_logprobs == outs[0].prompt_logprobs for o in outs)
    assert_same_scores(outs[0].prompt_logprobs, float64_scores(model, prompt, 2))


def test_identical_scored_prompts_added_mid_prefill_wait_for_its_scores(model, prompt):
    engine = engine_for(model)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    engine.add_request(prompt, params)
    engine.step()  # the first holds a slot: later ones cannot join its group
    for _ in range(3):
        engine.add_request(prompt, params)
    outs = []
    for _ in range(50):
        outs += engine.step()
        if len(outs) == 4:
            break
    # the second waits for its blocks and their scores, then runs the last 2 tokens (the scheduler
    # holds a request back only for a prefill that records its top-n); the last two join its group
    assert len(outs) == 4
    assert engine.stats()["prefill_tokens"] == 18 + 2 and engine.stats()["prompt_logprobs_cached"] == 16
    assert all(o.prompt_logprobs[:17] == outs[0].prompt_logprobs[:17] for o in outs)


def test_a_request_aborted_mid_prompt_has_no_partial_prompt_logprobs(model, prompt):
    engine = engine_for(model)
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    engine.step()  # 7 of 18 prompt tokens scored
    engine.abort(rid)
    (out,) = engine.step()
    assert out.finish_reason.value == "abort" and out.prompt_logprobs is None  # one per token, or none


def check_new_weights_get_new_scores(make_engine, prompt):
    """Scores cached under version 0 never answer a request under version 1."""
    old, new = tiny_llama(seed=3), tiny_llama(seed=4)
    engine = make_engine(old)
    scored(engine, prompt, 2)
    engine.update_weights(new.named_parameters())
    assert engine.allocator.state.prompt_logprobs == {}
    (out,), computed, cached = scored(engine, prompt, 2)
    assert cached == 0 and computed == 18
    assert_same_scores(out.prompt_logprobs, float64_scores(new, prompt, 2))
    assert engine.stats()["cross_version_prefix_hits"] == 0


def test_a_weight_update_drops_cached_scores_with_their_blocks(prompt):
    check_new_weights_get_new_scores(engine_for, prompt)


@pytest.fixture
def planted_stale_scores(monkeypatch):
    """Planted bug: the update forgets the prefix cache, and hashes ignore the policy version."""
    import inference.sched.context as context

    monkeypatch.setattr("inference.core.engine_core.EngineCore.reset_prefix_cache", lambda self: None)
    chain_key_of = context.DynamicInferenceContext.chain_key_of

    def versionless(self, fields):
        return chain_key_of(self, fields)[0], b""  # NOTE: the bytes every hash of the chain mixes in

    monkeypatch.setattr(context.DynamicInferenceContext, "chain_key_of", versionless)


def test_the_update_check_catches_stale_scores(prompt, planted_stale_scores):
    with pytest.raises(AssertionError):
        check_new_weights_get_new_scores(engine_for, prompt)


def test_prompt_logprobs_with_cached_scores_match_hf(model, prompt):
    engine = engine_for(model)
    scored(engine, prompt, 3)
    (out,), _, cached = scored(engine, prompt, 3)
    assert cached == 16
    assert_same_scores(out.prompt_logprobs, float64_scores(model, prompt, 3))
