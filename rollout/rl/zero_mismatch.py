"""`rollout grpo --zero-mismatch`: the trainer's forward runs on the engine's own kernels, in the
engine's order, on the weights the two share, so its log-probs equal the sampled ones bit for bit.

How: the engine samples in its batch-invariant mode (`InferenceConfig.batch_invariant`), where a
token's log-prob depends only on its own sequence; the trainer's forward
(`inference.models.dense.training.TrainingForward`) lays each sample out as one prefill and runs the
engine decoder's own pieces on it, each differentiable by torch's autograd of the same maths (at the
forward's values). The loss's log-probs are that forward's: recomputed from the weights, never
copied from the engine's outputs; the step's gradient is torch's autograd of the policy within fp32
rounding.

Covered where the mode and that forward are: the dense decoder on CPU, fp32 or bf16, the sampler's
log-probs at any temperature (RAW at 1, PROCESSED elsewhere), the full weights or a LoRA adapter;
colocated (the engine aliases the policy and its adapter) or disaggregated (the full weights; replicas
in processes of their own, on this machine's kernels, synced in fp32 every step, on policy: the trainer
runs the same kernels over its own weights, which each sync copies to them bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inference.lora import AdapterRef
from inference.models.dense.training import TrainingForward
from inference.models.loading import load_from_hf_model
from rollout.local import RolloutEngine


def engine_kernels_forward(engine: RolloutEngine, policy: torch.nn.Module, temperature: float = 1.0,
                           lora: Callable[[], AdapterRef] | None = None) -> TrainingForward:
    """The trainer's forward of `policy` on `engine`'s kernels (`engine` aliases `policy`'s weights and
    samples with `batch_invariant=True`) at the sampling `temperature`: `(input_ids, loss_mask) ->
    (logits, log-probs, targets)`. `lora`: the engine's current version of the policy's adapter (shared:
    `policy` is the PEFT model whose LoRA parameters it reads), asked at each call."""
    core = engine.engine
    if not core.config.batch_invariant:
        raise ValueError("engine_kernels_forward needs an engine with batch_invariant=True: elsewhere a token's "
                         "sampled log-prob depends on the batch it was sampled in")
    adapter = None if lora is None else (lambda: core.core.loras.adapter(lora().id))
    return _forward(core.model, policy, core.config.block_size, temperature, adapter)


def module_kernels_forward(policy: torch.nn.Module, block_size: int, temperature: float = 1.0) -> TrainingForward:
    """The trainer's forward of `policy` on the engine's kernels, over a decoder of its own that aliases
    `policy`'s weights (disaggregated: the replicas sample with the same kernels on a bitwise copy);
    `block_size`: the replicas'."""
    return _forward(load_from_hf_model(policy, share_weights=True), policy, block_size, temperature)


def _forward(decoder, policy: torch.nn.Module, block_size: int, temperature: float, adapter=None) -> TrainingForward:
    """`TrainingForward` of `decoder` with gradients to `policy`'s parameters (its embedding's padding row
    left without one, as torch leaves it)."""
    padding_idx = getattr(policy.get_input_embeddings(), "padding_idx", None)
    return TrainingForward(decoder, dict(policy.named_parameters()), block_size=block_size, padding_idx=padding_idx,
                           temperature=temperature, adapter=adapter)
