"""The trained policy of a LoRA run: a PEFT adapter of rank R on every linear projection of the
trainer's model, its base frozen, and what a disaggregated loop needs of it (the adapter's name on
the replicas, a fresh engine of base + adapter to check them against)."""

from __future__ import annotations

import copy
from typing import Any

import torch

LORA_NAME = "policy"  # what requests name; each sync is this adapter's next version on every replica
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_policy(model: torch.nn.Module, rank: int) -> tuple[Any, torch.nn.Module]:
    """(the PEFT model the trainer trains, a frozen copy of the base as it is now). PEFT injects its
    layers into `model` itself, so the copy is taken first (a fresh engine's base, at the end).
    B starts at zero (PEFT's default): version 1 of the adapter is the base model's policy."""
    from peft import LoraConfig, get_peft_model

    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"lora_rank must be an int >= 1, got {rank!r}")
    base = copy.deepcopy(model).eval()
    for p in base.parameters():
        p.requires_grad_(False)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
    return peft, base


def fresh_engine(base: torch.nn.Module, peft: Any, config: Any) -> Any:
    """A `RolloutEngine` of `base` serving the trainer's adapter as it is now (`LORA_NAME`)."""
    import dataclasses

    from rollout.local import RolloutEngine

    rank = peft.peft_config["default"].r
    engine = RolloutEngine(base, dataclasses.replace(config, max_loras=1, max_lora_rank=max(rank, 1)))
    engine.engine.load_lora_from_peft(LORA_NAME, peft)
    return engine


__all__ = ["LORA_NAME", "TARGETS", "fresh_engine", "lora_policy"]
