"""RolloutEngine: n samples per prompt as a RolloutBatch, seeded, with the engine's log-probs (those
the trainer's `token_logprobs` computes, run in float64 as the reference)."""

from __future__ import annotations

import torch

from inference import LogprobsMode, SamplingParams
from rollout.local import RolloutEngine
from rollout.rl.grpo import token_logprobs
from rollout.types import FinishReason
from tests.reference import float64_copy, float64_everywhere

from .conftest import small_engine_config, tiny_policy

PROMPTS = [[1, 4, 5], [1, 9], [1, 3, 4, 5, 6]]
# NOTE: |log p| < 4 (16 tokens), where half an fp32 ulp is 2.4e-7: measured max |engine - float64
# trainer| 9.5e-7 (the shifted weights below; 4e-7 otherwise), the fp32 trainer's own 9.5e-7; 1e-5 is 10x
LOGPROB_TOL = 1e-5


def float64_logprobs(model, padded, temperature: float = 1.0) -> torch.Tensor:
    """The trainer's log-probs of a padded batch (`rollout.rl.grpo.token_logprobs`), computed in float64."""
    with torch.no_grad(), float64_everywhere():
        return token_logprobs(float64_copy(model), padded.input_ids, padded.loss_mask, temperature=temperature)


def test_generate_groups_samples_in_prompt_order(policy):
    engine = RolloutEngine(policy, small_engine_config())
    batch = engine.generate(PROMPTS, n=4, sampling=SamplingParams(max_tokens=6, seed=1))
    assert len(batch) == 12 and batch.group_size == 4 and batch.num_groups == 3
    assert batch.groups == [0] * 4 + [1] * 4 + [2] * 4
    for i, r in enumerate(batch):
        assert r.prompt_ids == PROMPTS[i // 4] and r.sample_index == i % 4
        assert 1 <= len(r.completion_ids) <= 6
        assert len(r.logprobs) == len(r.completion_ids) and all(lp <= 0 for lp in r.logprobs)
        assert r.versions == [0] * len(r.completion_ids)
        assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    stats = batch.stats
    assert stats.completion_tokens == sum(batch.completion_lengths) and stats.engine_steps >= 6
    assert 0 < stats.peak_kv_utilization <= 1 and stats.tokens_per_second > 0
    again = engine.generate(PROMPTS, n=4, sampling=SamplingParams(max_tokens=6, seed=1))
    assert again.groups == batch.groups  # group indices are per batch, not the engine's counters


def test_seeded_generation_is_reproducible_across_engines():
    runs = []
    for _ in range(2):
        engine = RolloutEngine(tiny_policy(seed=3), small_engine_config())
        batch = engine.generate(PROMPTS * 4, n=3, sampling=SamplingParams(max_tokens=8, seed=42))
        runs.append([(r.completion_ids, r.logprobs) for r in batch])
    assert runs[0] == runs[1]
    # distinct prompts (and samples) draw distinct streams: not all the same completion
    assert len({tuple(c) for c, _ in runs[0]}) > 1


def test_nearby_prompt_seeds_do_not_replay_each_others_samples():
    # prompt i is seeded seed + i; the engine mixes (seed, sample index), so prompt 0's sample 1
    # must not replay prompt 1's sample 0 on the same prompt text
    engine = RolloutEngine(tiny_policy(seed=3), small_engine_config())
    batch = engine.generate([PROMPTS[0]] * 2, n=2, sampling=SamplingParams(max_tokens=12, seed=7))
    by_group = [[r.completion_ids for r in batch if r.group == g] for g in (0, 1)]
    assert by_group[0][1] != by_group[1][0]


def test_engine_logprobs_equal_the_trainers(policy):
    engine = RolloutEngine(policy, small_engine_config())
    batch = engine.generate(PROMPTS, n=8, sampling=SamplingParams(max_tokens=10, seed=0))
    padded = batch.to_padded_tensors()
    trainer = float64_logprobs(policy, padded)
    assert (trainer - padded.old_logprobs[padded.loss_mask].double()).abs().max() <= LOGPROB_TOL


def test_weights_are_aliased_not_copied(policy):
    engine = RolloutEngine(policy, small_engine_config())
    report = engine.engine.model.bind_report
    assert report.copied == {} and len(report.aliased) == len(engine.engine.model.spec.weight_shapes())
    engine_embed = engine.engine.model.named_tensors()["model.embed_tokens.weight"]
    assert engine_embed.data_ptr() == policy.model.embed_tokens.weight.data_ptr()


def test_processed_logprobs_equal_the_trainers_at_a_temperature(policy):
    engine = RolloutEngine(policy, small_engine_config())
    sampling = SamplingParams(max_tokens=10, seed=0, temperature=0.7, logprobs_mode=LogprobsMode.PROCESSED)
    batch = engine.generate(PROMPTS, n=8, sampling=sampling)
    padded = batch.to_padded_tensors()
    trainer = float64_logprobs(policy, padded, temperature=0.7)
    raw = float64_logprobs(policy, padded)
    engine_lp = padded.old_logprobs[padded.loss_mask].double()
    assert (trainer - engine_lp).abs().max() <= LOGPROB_TOL
    assert (raw - engine_lp).abs().max() > 1e-3  # the temperature does matter


def test_copied_weights_follow_update_weights_and_bind_trainer_model():
    trainer = tiny_policy(seed=0)
    engine = RolloutEngine(tiny_policy(seed=5), small_engine_config(), share_weights=False)
    sampling = SamplingParams(max_tokens=6, seed=0)

    def mismatch():
        batch = engine.generate(PROMPTS, n=4, sampling=sampling)
        padded = batch.to_padded_tensors()
        lp = float64_logprobs(trainer, padded)
        return float((lp - padded.old_logprobs[padded.loss_mask].double()).abs().max()), batch.versions

    assert mismatch()[0] > 1e-2  # another model's weights
    assert engine.update_weights(dict(trainer.named_parameters()), version=7) == 7
    diff, versions = mismatch()
    assert diff <= LOGPROB_TOL and versions == {7} and engine.policy_version == 7
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05)  # the engine holds a copy: it does not see this
    assert mismatch()[0] > 1e-3
    engine.bind_trainer_model(trainer)  # from now on it aliases
    with torch.no_grad():
        for p in trainer.parameters():
            p.sub_(0.01)
    engine.on_weights_updated()
    diff, versions = mismatch()
    assert diff <= LOGPROB_TOL and versions == {8}
