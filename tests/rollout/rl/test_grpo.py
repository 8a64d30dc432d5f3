"""Group-relative advantages, the clipped loss, and the trainer's log-prob recomputation."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from inference import SamplingParams
from rollout.local import RolloutEngine
from rollout.rl.grpo import (
    gather_logprobs,
    group_advantages,
    grpo_loss,
    grpo_step,
    predicting_logits,
    shortfall_entropy,
    token_entropy,
    token_logprobs,
)
from rollout.types import FinishReason, Rollout, RolloutBatch
from tests.rollout.conftest import small_engine_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_advantages_are_centred_and_scaled_per_group():
    adv = group_advantages([1.0, 0.0, 0.5, 0.5, 0.2, 0.4], [0, 0, 1, 1, 2, 2])
    assert adv[:2].tolist() == pytest.approx([1.0, -1.0], abs=1e-5)
    assert adv[2:4].tolist() == [0.0, 0.0]  # no signal in a group that scored alike
    assert adv[4:].tolist() == pytest.approx([-1.0, 1.0], abs=1e-4)
    unscaled = group_advantages([1.0, 0.0], [0, 0], scale=False)
    assert unscaled.tolist() == [0.5, -0.5]
    with pytest.raises(ValueError, match="rewards"):
        group_advantages([1.0], [0, 0])


def test_loss_on_policy_is_minus_the_advantage_and_clips_outside_the_range():
    lp = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    old = torch.tensor([-1.0, -1.0, -1.5, -0.5])  # ratios 1, 1, e^0.5, e^-0.5
    loss, clipped = grpo_loss(lp, old, adv, clip_eps=0.2)
    assert loss[:2].tolist() == [-1.0, 1.0]
    assert loss[2].item() == pytest.approx(-1.2) and loss[3].item() == pytest.approx(0.8)
    assert clipped.tolist() == [False, False, True, True]


def test_token_logprobs_match_the_full_forward(policy):
    ids = torch.tensor([[1, 4, 5, 6, 2, 0], [1, 9, 10, 11, 12, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    got = token_logprobs(policy, ids, mask)
    with torch.no_grad():
        full = policy(ids).logits.float().log_softmax(-1)
    rows, cols = mask.nonzero(as_tuple=True)
    expected = full[rows, cols - 1].gather(-1, ids[rows, cols][:, None]).squeeze(-1)
    assert got.shape == (int(mask.sum()),) and got.requires_grad
    assert torch.allclose(got.detach(), expected, atol=1e-6)
    with pytest.raises(ValueError, match="first position"):
        token_logprobs(policy, ids, torch.ones_like(mask))


def test_grpo_step_raises_the_rewarded_completion(policy):
    prompt, good, bad = [1, 4], [5, 6, 2], [9, 9, 9]
    with torch.no_grad():
        def logp(completion):
            ids = torch.tensor([prompt + completion])
            mask = torch.tensor([[False] * len(prompt) + [True] * len(completion)])
            return token_logprobs(policy, ids, mask)

        lp_good, lp_bad = logp(good), logp(bad)
    batch = RolloutBatch([
        Rollout(prompt, good, lp_good.tolist(), [0] * 3, FinishReason.STOP, group=0),
        Rollout(prompt, bad, lp_bad.tolist(), [0] * 3, FinishReason.LENGTH, group=0),
    ], group_size=2)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    stats = grpo_step(policy, optimizer, batch, [1.0, 0.0], micro_batch_size=1)
    # NOTE: old log-probs are the trainer's own here; the mismatch is checked against the engine below
    assert stats.tokens == 6 and stats.clip_fraction == 0.0
    with torch.no_grad():
        assert logp(good).sum() > lp_good.sum() and logp(bad).sum() < lp_bad.sum()


def check_engine_and_trainer_agree(policy):
    """grpo_step's mismatch compares the engine's log-probs (sampled, RAW at T=1) with the
    trainer's recomputation under the same weights: float rounding only."""
    engine = RolloutEngine(policy, small_engine_config())
    prompts = [[1, 4, 5], [1, 9], [1, 3, 4, 5, 6]]
    batch = engine.generate(prompts, n=4, sampling=SamplingParams(max_tokens=8, seed=3))
    rewards = [len(r.completion_ids) / 8 for r in batch]
    stats = grpo_step(policy, torch.optim.SGD(policy.parameters(), lr=1e-3), batch, rewards, micro_batch_size=5)
    assert stats.tokens == sum(batch.completion_lengths) > 20
    assert stats.mismatch_max <= 1e-5, f"engine and trainer disagree by {stats.mismatch_max:.2e}"


def test_grpo_step_measures_the_engine_against_the_trainer(policy):
    check_engine_and_trainer_agree(policy)


@pytest.fixture
def planted_trainer_reads_the_wrong_position(monkeypatch):
    """Planted bug: the trainer scores each token with the logits of its own position (off by one)."""
    def shifted(model, input_ids, loss_mask, temperature=1.0):
        rows, cols = loss_mask.nonzero(as_tuple=True)
        logits = model(input_ids).logits[rows, cols].float()
        return logits / temperature, input_ids[rows, cols]

    monkeypatch.setattr("rollout.rl.grpo.predicting_logits", shifted)


@pytest.fixture
def planted_misaligned_old_logprobs(monkeypatch):
    """Planted bug: the padded batch puts the engine's log-probs one position late."""
    to_padded = RolloutBatch.to_padded_tensors

    def misaligned(self, *args, **kwargs):
        padded = to_padded(self, *args, **kwargs)
        padded.old_logprobs.copy_(padded.old_logprobs.roll(1, dims=1))
        return padded

    monkeypatch.setattr(RolloutBatch, "to_padded_tensors", misaligned)


@pytest.mark.parametrize("planted", ["planted_trainer_reads_the_wrong_position", "planted_misaligned_old_logprobs"])
def test_the_mismatch_check_catches_misaligned_logprobs(policy, planted, request):
    request.getfixturevalue(planted)
    with pytest.raises(AssertionError, match="disagree"):
        check_engine_and_trainer_agree(policy)


def test_gather_logprobs_is_accurate_over_a_large_vocabulary():
    torch.manual_seed(0)
    logits = (torch.randn(64, 49152) * 4 + 20).requires_grad_()
    targets = torch.randint(0, 49152, (64,))
    exact = logits.detach().double().log_softmax(-1)[torch.arange(64), targets]
    got = gather_logprobs(logits, targets)
    # NOTE: torch's own fp32 log_softmax errs by ~1e-5 here: the engine comparison needs better.
    # 3e-6: the log of a 49k-term fp32 sum near e^0..e^16 (relative error ~20 ulp), measured 1-2e-6
    assert (got.detach().double() - exact).abs().max() < 3e-6
    got.sum().backward()
    # the gradient of log p[target] against float64: one_hot - softmax, exactly
    expected_grad = torch.nn.functional.one_hot(targets, 49152).double() - logits.detach().double().softmax(-1)
    # NOTE: each entry is exp(x - max) / sum in fp32: a few ulp of a value <= 1 (measured ~1.1e-7);
    # torch's fp32 softmax is itself up to ~1e-5 off here on some CPUs, so it cannot be the reference
    assert (logits.grad.double() - expected_grad).abs().max() < 1e-6


def test_token_entropy_against_float64():
    torch.manual_seed(1)
    logits = torch.randn(32, 1000) * 5
    p = logits.double().softmax(-1)
    exact = -(p * p.log()).sum(-1)
    # NOTE: sums of 1000 fp32 terms of size <= ~0.4: ~20 ulp of the entropy (<= ~7 nats), measured ~5e-7
    assert (token_entropy(logits).double() - exact).abs().max() < 5e-6
    masked = torch.tensor([[0.0, -float("inf")], [0.0, 0.0]], requires_grad=True)
    entropy = token_entropy(masked)  # a masked token has probability 0: no entropy, no NaN
    assert entropy[0].item() == 0.0 and entropy[1].item() == pytest.approx(math.log(2))
    entropy.sum().backward()
    assert torch.isfinite(masked.grad).all()


def stuck_batch(policy, completion=(9, 9, 9)):
    """A group whose two samples agree (no signal): only the entropy bonus moves the policy."""
    prompt = [1, 4]
    ids = torch.tensor([prompt + list(completion)])
    mask = torch.tensor([[False] * len(prompt) + [True] * len(completion)])
    with torch.no_grad():
        lp = token_logprobs(policy, ids, mask).tolist()
    rollout = Rollout(prompt, list(completion), lp, [0] * len(completion), FinishReason.LENGTH, group=0)
    return RolloutBatch([rollout, rollout], group_size=2), ids, mask


def test_the_entropy_bonus_moves_a_group_without_signal(policy):
    batch, ids, mask = stuck_batch(policy)
    entropy = lambda: float(token_entropy(predicting_logits(policy, ids, mask)[0]).mean().detach())  # noqa: E731
    before = entropy()
    stats = grpo_step(policy, torch.optim.SGD(policy.parameters(), lr=0.5), batch, [0.3, 0.3], entropy_coef=0.0)
    assert stats.signal_fraction == 0.0 and stats.advantage_std == 0.0 and stats.grad_norm == 0.0
    assert entropy() == before  # no signal, no bonus: nothing moves
    stats = grpo_step(policy, torch.optim.SGD(policy.parameters(), lr=0.5), batch, [0.3, 0.3], entropy_coef=0.1)
    assert stats.grad_norm > 0 and stats.entropy == pytest.approx(before, rel=1e-5)
    assert entropy() > before


def test_signal_fraction_counts_groups_whose_rewards_differ(policy):
    batch, _, _ = stuck_batch(policy)
    two_groups = RolloutBatch([*batch, *[dataclasses.replace(r, group=1) for r in batch]], group_size=2)
    stats = grpo_step(policy, torch.optim.SGD(policy.parameters(), lr=0.0), two_groups, [0.3, 0.3, 0.0, 1.0])
    assert stats.signal_fraction == 0.5 and stats.advantage_std == pytest.approx(0.5 ** 0.5, rel=1e-4)


def test_the_entropy_bonus_goes_to_groups_that_fall_short():
    groups, rewards = [0, 0, 1, 1, 2, 2], [1.0, 1.0, 0.5, 0.0, 0.25, 0.25]
    coefs = shortfall_entropy(rewards, groups, 0.05)
    assert coefs == pytest.approx([0.0, 0.0, 0.0375, 0.0375, 0.0375, 0.0375])
    assert shortfall_entropy(rewards, groups, 0.0) == [0.0] * 6
    assert shortfall_entropy([2 * r for r in rewards], groups, 0.05, max_reward=2.0) == pytest.approx(coefs)
    with pytest.raises(ValueError, match="rewards"):
        shortfall_entropy(rewards[:3], groups, 0.05)
