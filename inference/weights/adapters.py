"""How a trainer's module (or an update's names) becomes the engine's HF-named tensors.

HF `*ForCausalLM` modules and HF names are native. Other layouts (megatron-core's fused QKV and
gate/up) are handled by adapters that `weight_sync` registers when imported, so `inference`
never imports `weight_sync` (imports go rollout -> weight_sync -> inference).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

HFTensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class WeightAdapter:
    """`matches_module(module)` / `matches_names(names)` say whether this adapter applies;
    `module_to_hf(module, spec)` and `names_to_hf(named, spec)` return HF-named tensors (views of
    the source where layouts allow, converted copies elsewhere)."""

    name: str
    matches_module: Callable[[object], bool]
    matches_names: Callable[[list[str]], bool]
    module_to_hf: Callable[[object, object], HFTensors]
    names_to_hf: Callable[[HFTensors, object], HFTensors]


_ADAPTERS: dict[str, WeightAdapter] = {}


def register_weight_adapter(adapter: WeightAdapter) -> None:
    _ADAPTERS[adapter.name] = adapter


def adapter_for_module(module: object) -> WeightAdapter | None:
    return next((a for a in _ADAPTERS.values() if a.matches_module(module)), None)


def adapter_for_names(names: list[str]) -> WeightAdapter | None:
    return next((a for a in _ADAPTERS.values() if a.matches_names(names)), None)
