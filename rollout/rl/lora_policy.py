"""The colocated LoRA policy of `rollout grpo --lora R`: PEFT on the trainer's side, the engine
reading the adapter in place.

The trainer wraps its model with PEFT (`get_peft_model`): the base weights are frozen and only the
adapter's A and B train. The engine already aliases the base weights (`share_weights`) and now
aliases the adapter too (`load_lora_from_peft(..., share=True)`): the optimizer's in-place steps
are what the engine reads, so a "sync" moves no bytes. After each step the adapter is loaded again
as its next version (the registry's bookkeeping only): requests name the adapter, each sample
records the version that sampled it, and the prefix cache, whose block key holds the adapter's
version, never serves a block computed under the previous one. The base policy version never
moves: the base weights never change.

Disaggregated (`trained_lora`, `fresh_engine`): the same PEFT adapter on the trainer, synced alone
to the replicas each step (`WeightSender.sync_lora`) as `ADAPTER_NAME`'s next version there.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from inference.errors import LoRALoadError
from inference.lora import LORA_PROJECTIONS, AdapterRef
from rollout.local import RolloutEngine

ADAPTER_NAME = "policy"  # what the loop's requests name (`SamplingParams.lora_name`)
ALL_LINEAR = LORA_PROJECTIONS  # every linear layer of attention and MLP (what the engine can adapt)


def lora_config(rank: int, alpha: float, targets: tuple[str, ...]) -> Any:
    """The trained adapter's PEFT config. NOTE: dropout 0 and no bias: the engine computes exactly
    x A^T B^T * scaling, so the trainer's recomputation matches the sampler's log-probs (the mismatch check)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")


@dataclass(slots=True)
class ColocatedLoRA:
    """The trainer's PEFT model and the engine's aliased adapter.

    Invariant: the engine's current version of `ADAPTER_NAME` reads the PEFT model's LoRA
    parameters themselves (checked by address at every load), and `ref.version` is 1 + the
    number of optimizer steps taken."""

    engine: RolloutEngine
    model: Any  # peft.PeftModel around the trainer's HF model
    ref: AdapterRef

    @classmethod
    def attach(cls, engine: RolloutEngine, policy: torch.nn.Module, *, rank: int, alpha: float,
               targets: tuple[str, ...]) -> ColocatedLoRA:
        """Wrap `policy` (whose base weights `engine` already aliases) with a fresh LoRA adapter
        and load it into `engine`, shared. PEFT's B starts at zero: step 0 samples the base policy."""
        from peft import get_peft_model

        model = get_peft_model(policy, lora_config(rank, alpha, targets))
        ref = engine.load_lora_from_peft(ADAPTER_NAME, model, share=True)
        lora = cls(engine, model, ref)
        lora.check_aliased()
        return lora

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def updated(self) -> int:
        """The optimizer stepped the adapter in place: make it the adapter's next version (no copy)."""
        self.ref = self.engine.load_lora_from_peft(ADAPTER_NAME, self.model, share=True)
        self.check_aliased()
        return self.ref.version

    def check_aliased(self) -> None:
        """`LoRALoadError` unless every tensor the engine reads for the adapter is a PEFT parameter."""
        adapter = self.engine.engine.core.loras.adapter(self.ref.id)
        own = {p.data_ptr() for n, p in self.model.named_parameters() if "lora_" in n}
        # NOTE: what the forward reads (`fused`): B^T is a view whose address is B's
        served = [t for layer in adapter.fused for blocks in layer.values()
                  for a, _, parts in blocks for t in (a, *(bt for *_, bt in parts))]
        copied = sum(t.data_ptr() not in own for t in served)
        if not adapter.shared or copied or len(served) != len(own):
            raise LoRALoadError(f"LoRA adapter {ADAPTER_NAME!r} is not aliased: {copied} of {len(served)} served "
                                f"tensors are copies ({len(own)} trainer LoRA parameters)")


def trained_lora(model: torch.nn.Module, *, rank: int, alpha: float,
                 targets: tuple[str, ...] = ALL_LINEAR) -> tuple[Any, torch.nn.Module]:
    """(the PEFT model a disaggregated trainer trains, a frozen copy of the base as it is now). PEFT
    injects its layers into `model` itself, so the copy is taken first (a fresh engine's base, at the
    end). B starts at zero (PEFT's default): version 1 of the adapter is the base model's policy."""
    from peft import get_peft_model

    base = copy.deepcopy(model).eval()
    for p in base.parameters():
        p.requires_grad_(False)
    return get_peft_model(model, lora_config(rank, alpha, targets)), base


def fresh_engine(base: torch.nn.Module, peft: Any, config: Any) -> RolloutEngine:
    """A `RolloutEngine` of `base` serving the trainer's adapter as it is now (`ADAPTER_NAME`, copied)."""
    rank = peft.peft_config["default"].r
    engine = RolloutEngine(base, dataclasses.replace(config, max_loras=1, max_lora_rank=max(rank, 1)))
    engine.engine.load_lora_from_peft(ADAPTER_NAME, peft)
    return engine
