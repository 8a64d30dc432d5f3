"""`rollout grpo --zero-mismatch`: the trainer's log-probs of a sampled batch computed by the engine's
own kernels, in the engine's order, on the trainer's weights, so they equal the sampled ones bit for bit.

How: the engine runs in its batch-invariant mode (`InferenceConfig.batch_invariant`), where a prefill
row is the same bits as the decode row that sampled it; each sample's prompt + completion is scored
as a prompt (`prompt_logprobs`), on the engine's decoder, which aliases the trainer's parameters
(colocated), and its RAW log-probs use the sampler's own normaliser. Those are the trainer's values;
its gradients are the plain torch forward's (`with_exact_values`: the value of one, the gradient of
the other), so a step's gradient is torch's autograd of the policy, within fp32 rounding of the
gradient at the exact values. Nothing is copied from the sampled outputs: the scoring recomputes
every log-prob from the weights.

Covered where the mode is: the dense decoder on CPU, fp32 or bf16, RAW log-probs (temperature 1),
no LoRA.
"""

from __future__ import annotations

from typing import Any

import torch

from inference import SamplingParams
from rollout.types import RolloutBatch


class _ExactValues(torch.autograd.Function):
    """`exact`'s values, `plain`'s gradient."""

    @staticmethod
    def forward(ctx: Any, plain: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        return exact.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def with_exact_values(plain: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """A tensor whose values are `exact`'s and whose gradient flows to `plain` (same shape)."""
    if plain.shape != exact.shape:
        raise ValueError(f"with_exact_values: plain {tuple(plain.shape)} and exact {tuple(exact.shape)} differ")
    return _ExactValues.apply(plain, exact.to(plain.dtype))


def engine_logprobs(engine: Any, batch: RolloutBatch) -> torch.Tensor:
    """Each completion token's RAW log-prob recomputed by `engine` (a `DynamicInferenceEngine` in its
    batch-invariant mode) from its current weights: `[B, T]` laid out as `batch.to_padded_tensors()`'s
    `old_logprobs` (zeros outside the completions)."""
    if not engine.config.batch_invariant:
        raise ValueError("engine_logprobs needs an engine with batch_invariant=True: elsewhere a prefill row and "
                         "the decode row that sampled it may round apart")
    rollouts = list(batch)
    scored = engine.generate([r.prompt_ids + r.completion_ids for r in rollouts],
                             SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    out = torch.zeros(len(rollouts), max(r.num_tokens for r in rollouts), dtype=torch.float32)
    for row, (r, s) in enumerate(zip(rollouts, scored)):
        start = len(r.prompt_ids)
        values = [s.prompt_logprobs[start + j][token] for j, token in enumerate(r.completion_ids)]
        out[row, start:start + len(values)] = torch.tensor(values, dtype=torch.float32)
    return out
