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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from inference.errors import LoRALoadError
from inference.lora import AdapterRef
from rollout.local import RolloutEngine

ADAPTER_NAME = "policy"  # what the loop's requests name (`SamplingParams.lora_name`)
# every linear layer of attention and MLP (what `inference.models.dense` can adapt)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
        from peft import LoraConfig, get_peft_model

        # NOTE: dropout 0 and no bias: the engine computes exactly x A^T B^T * scaling, so the
        # trainer's recomputation matches the sampler's log-probs (the mismatch check)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
        model = get_peft_model(policy, config)
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
