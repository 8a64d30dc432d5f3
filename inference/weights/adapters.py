"""How a trainer's module (or an update's names) becomes the engine's HF-named tensors.

HF `*ForCausalLM` modules and HF names are native. Another layout (megatron-core's fused QKV and
gate/up) comes with the adapter that converts it, passed by the caller
(`engine.bind_trainer_model(gpt_model, adapter=weight_sync.MEGATRON_ADAPTER)`): nothing registers
at import, and `inference` never imports `weight_sync` (imports go rollout -> weight_sync -> inference).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

HFTensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class WeightAdapter:
    """`module_to_hf(module, spec)` and `names_to_hf(named, spec)` return HF-named tensors (views of
    the source where layouts allow, converted copies elsewhere)."""

    name: str
    module_to_hf: Callable[[object, object], HFTensors]
    names_to_hf: Callable[[HFTensors, object], HFTensors]

