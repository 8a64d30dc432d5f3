"""Group-relative advantages, the clipped loss, and the trainer's log-prob recomputation."""

from __future__ import annotations

import pytest
import torch

from rollout.grpo import gather_logprobs, group_advantages, grpo_loss, grpo_step, token_logprobs
from rollout.types import FinishReason, Rollout, RolloutBatch


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
    assert stats.tokens == 6 and stats.mismatch_max < 1e-5 and stats.clip_fraction == 0.0
    with torch.no_grad():
        assert logp(good).sum() > lp_good.sum() and logp(bad).sum() < lp_bad.sum()


def test_gather_logprobs_is_accurate_over_a_large_vocabulary():
    torch.manual_seed(0)
    logits = (torch.randn(64, 49152) * 4 + 20).requires_grad_()
    targets = torch.randint(0, 49152, (64,))
    exact = logits.detach().double().log_softmax(-1)[torch.arange(64), targets]
    got = gather_logprobs(logits, targets)
    # torch's own fp32 log_softmax errs by ~1e-5 here: the engine comparison needs better
    assert (got.detach().double() - exact).abs().max() < 3e-6
    got.sum().backward()
    expected_grad = torch.nn.functional.one_hot(targets, 49152) - logits.detach().softmax(-1)
    assert torch.allclose(logits.grad, expected_grad.float(), atol=1e-6)
