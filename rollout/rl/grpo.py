"""GRPO on padded rollout tensors: group-relative advantages, the clipped loss, one optimizer step.

The trainer recomputes the log-probs of the sampled tokens in the same forward pass as the loss,
before the optimizer step, so the difference to the engine's log-probs (`old_logprobs`) is the
train-inference mismatch of identical weights: kernel rounding and nothing else.

Token tensors here are *flat*: one entry per completion token, in the row-major order of
`loss_mask.nonzero()`, so `old_logprobs[loss_mask]` lines up with them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from inference.models.moe.routing_replay import pad_routes, replay_routing
from rollout.types import PaddedBatch, RolloutBatch, group_slices

__all__ = ["TrainStats", "gather_logprobs", "group_advantages", "grpo_loss", "grpo_step", "predicting_logits",
           "shortfall_entropy", "token_entropy", "token_logprobs"]


def group_advantages(
    rewards: Sequence[float], groups: Sequence[int], *, scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """`[B]` float32: each reward minus its group's mean, divided by the group's std if `scale`.

    Groups must be contiguous (a `RolloutBatch` keeps them so). A group whose samples all scored
    the same carries no signal: its advantages are exactly 0.
    """
    if len(rewards) != len(groups):
        raise ValueError(f"group_advantages: {len(rewards)} rewards for {len(groups)} samples")
    r = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    for start, end in group_slices(groups):
        g = r[start:end]
        centred = g - g.mean()
        if scale:
            centred = centred / (g.std(unbiased=False) + eps)
        out[start:end] = centred
    return out.float()


def shortfall_entropy(rewards: Sequence[float], groups: Sequence[int], coef: float,
                      max_reward: float = 1.0) -> list[float]:
    """Per-sample entropy coefficients for `grpo_step`: `coef` x how far the sample's group's mean
    reward falls below `max_reward` (as a fraction of it). Mastered groups get none and sharpen
    freely; a group that falls short keeps exploring, even when its samples all agree (a group
    without signal has advantages of 0, so nothing else moves it)."""
    if len(rewards) != len(groups):
        raise ValueError(f"shortfall_entropy: {len(rewards)} rewards for {len(groups)} samples")
    out = [0.0] * len(rewards)
    if coef:
        for start, end in group_slices(groups):
            deficit = max(0.0, max_reward - sum(rewards[start:end]) / (end - start)) / max_reward
            out[start:end] = [coef * deficit] * (end - start)
    return out


def token_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, loss_mask: torch.Tensor, temperature: float = 1.0,
    routes: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Flat `[N]` log-probs (fp32, with grad) of the tokens where `loss_mask` is True, under
    `softmax(logits / temperature)` (the engine's PROCESSED log-probs when sampling untruncated at T)."""
    logits, targets = predicting_logits(model, input_ids, loss_mask, temperature, routes)
    return gather_logprobs(logits, targets)


def predicting_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, loss_mask: torch.Tensor, temperature: float = 1.0,
    routes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`[N, vocab]` fp32 logits / temperature, with grad, of the positions predicting the tokens
    where `loss_mask` is True; `[N]` those tokens), in the row-major order of `loss_mask.nonzero()`.

    Only the N predicting positions go through the LM head (a `[N, vocab]` logits matrix, not
    `[B, T, vocab]`). Right padding means no attention mask is needed: a real token never attends
    to a later position, so the padding after it is invisible under the causal mask.

    With `routes [B, T, moe_layers, k]` (an MoE model), every token goes to the experts the engine
    chose for it (`inference.models.moe.routing_replay`).
    """
    if loss_mask[:, 0].any():
        raise ValueError("token_logprobs: the first position has nothing to predict it")
    rows, cols = loss_mask.nonzero(as_tuple=True)
    targets = input_ids[rows, cols]
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    replay = replay_routing(model, routes) if routes is not None else contextlib.nullcontext()
    with replay:
        hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    logits = head(hidden[rows, cols - 1]).float()
    return (logits if temperature == 1.0 else logits / temperature), targets


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits)[i, targets[i]]` for `[N, V]` logits, differentiable, accurate in fp32.

    NOTE: not `log_softmax`: torch's fp32 CPU kernel errs by up to ~1e-5 over a 49k vocabulary
    (SmolLM2), which would swamp the engine/trainer comparison; (x - max) - log(sum(exp(x - max)))
    stays within ~2e-6, like the engine's sampler.
    """
    shifted = logits - logits.detach().amax(-1, keepdim=True)
    return shifted.gather(-1, targets[:, None]).squeeze(-1) - shifted.exp().sum(-1).log()


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """`[N]` entropy (nats) of `softmax(logits)` per row, differentiable; -inf logits (masked
    tokens) count as probability 0, whose p log p is 0."""
    logp = logits - logits.detach().amax(-1, keepdim=True)
    logp = logp - logp.exp().sum(-1, keepdim=True).log()
    p = logp.exp()
    # NOTE: zero the log where p is 0 before the product: 0 x -inf is NaN, in the backward pass too
    return -(p * torch.where(p > 0, logp, 0.0)).sum(-1)


def grpo_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *, clip_eps: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate `-min(r A, clip(r, 1-eps, 1+eps) A)`, r = exp(lp - old); flat `[N]`.

    Returns (per-token loss, per-token "was clipped" flag). The caller reduces (token mean).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).detach()


@dataclass(slots=True)
class TrainStats:
    loss: float
    grad_norm: float
    clip_fraction: float
    mismatch_mean: float  # mean |engine log-prob - trainer log-prob| over sampled tokens
    mismatch_max: float
    tokens: int
    entropy: float = 0.0  # mean per-token entropy (nats) of the sampling distribution, before the step
    signal_fraction: float = 0.0  # share of groups whose rewards differ (the others' advantages are 0)
    advantage_std: float = 0.0  # spread of the per-sample advantages
    mismatched_tokens: int = 0  # sampled tokens whose trainer log-prob is not the engine's bit for bit


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    rewards: Sequence[float],
    *,
    clip_eps: float = 0.2,
    max_grad_norm: float = 1.0,
    micro_batch_size: int | None = None,
    pad_id: int = 0,
    temperature: float = 1.0,
    routed_experts: Optional[Sequence[Optional[np.ndarray]]] = None,
    entropy_coef: Union[float, Sequence[float]] = 0.0,
    scale_advantages: bool = True,
    trainer_forward: Optional[Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]] = None,
) -> TrainStats:
    """One GRPO optimizer step on `batch`, in place on `model` (whose parameters the engine may alias).

    The loss is the token mean over every completion token of the batch (micro-batches are
    weighted so the sum is exact). Mismatch figures compare the engine's log-probs with the
    trainer's recomputation under the same weights, before the step. `temperature` must match
    the log-probs in `batch`: 1 for RAW ones, the sampling temperature for PROCESSED ones.
    `routed_experts` (an MoE policy: each row's `RequestOutput.routed_experts`) replays the
    engine's routing in the trainer's forward. `entropy_coef` (one for all, or one per sample) adds
    `-coef x` each token's entropy of the sampling distribution to the token-mean loss (an
    exploration bonus). `trainer_forward` (`rollout.rl.zero_mismatch`): `(input_ids, loss_mask) ->
    (logits, log-probs, targets)` in place of the model's own forward, e.g. one on the engine's kernels.
    """
    device = next(model.parameters()).device
    padded: PaddedBatch = batch.to_padded_tensors(pad_id=pad_id, device=device)
    adv_rows = group_advantages(rewards, batch.groups, scale=scale_advantages).to(device)
    per_sample = not isinstance(entropy_coef, (int, float))
    if per_sample and len(entropy_coef) != len(batch):
        raise ValueError(f"grpo_step: {len(entropy_coef)} entropy coefficients for {len(batch)} samples")
    bonus_rows = torch.tensor(entropy_coef if per_sample else [entropy_coef] * len(batch), dtype=torch.float32,
                              device=device)
    bonus = bool((bonus_rows != 0).any())
    if routed_experts is not None and len(routed_experts) != len(batch):
        raise ValueError(f"grpo_step: {len(routed_experts)} routes for {len(batch)} samples")
    routes = None if routed_experts is None else pad_routes(routed_experts, padded.input_ids.shape[1]).to(device)
    total = int(padded.loss_mask.sum())
    if total == 0:
        raise ValueError("grpo_step: the batch has no completion token")
    rows = len(batch)
    step = micro_batch_size or rows
    loss_sum, clipped, entropy_sum, diffs = 0.0, 0, 0.0, []
    optimizer.zero_grad(set_to_none=True)
    for start in range(0, rows, step):
        sl = slice(start, start + step)
        mask = padded.loss_mask[sl]
        if not mask.any():
            continue
        replayed = {} if routes is None else {"routes": routes[sl]}
        if trainer_forward is None:
            logits, targets = predicting_logits(model, padded.input_ids[sl], mask, temperature, **replayed)
            lp = gather_logprobs(logits, targets)
        else:
            logits, lp, targets = trainer_forward(padded.input_ids[sl], mask)
        old = padded.old_logprobs[sl][mask]
        adv = adv_rows[sl][:, None].expand_as(mask)[mask]
        per_token, was_clipped = grpo_loss(lp, old, adv, clip_eps=clip_eps)
        entropy = token_entropy(logits if bonus else logits.detach())
        if bonus:
            per_token = per_token - bonus_rows[sl][:, None].expand_as(mask)[mask] * entropy
        loss = per_token.sum() / total
        loss.backward()
        entropy_sum += float(entropy.detach().sum())
        loss_sum += float(loss.detach())
        clipped += int(was_clipped.sum())
        diffs.append((lp.detach() - old).abs())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    diff = torch.cat(diffs)
    spans = group_slices(batch.groups)
    signal = sum(max(rewards[a:b]) != min(rewards[a:b]) for a, b in spans) / max(1, len(spans))
    return TrainStats(
        loss=loss_sum,
        grad_norm=float(grad_norm),
        clip_fraction=clipped / total,
        mismatch_mean=float(diff.mean()),
        mismatch_max=float(diff.max()),
        tokens=total,
        entropy=entropy_sum / total,
        signal_fraction=signal,
        advantage_std=float(adv_rows.std(unbiased=False)),
        mismatched_tokens=int((diff != 0).sum()),
    )

