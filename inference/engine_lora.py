"""`DynamicInferenceEngine`'s LoRA calls: adapters read and checked on the caller's thread, made
resident on the engine's loop (a mixin over the engine's `core` and `calls`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import torch

from inference.errors import LoRALoadError
from inference.lora import AdapterInfo, AdapterRef, LoRAAdapter, load_live_peft_adapter, load_peft_adapter
from inference.lora.adapter import AdapterShape, adapter_from_tensors, check_adapter_shapes


class EngineLoRACalls:
    """The LoRA calls of `DynamicInferenceEngine` (module docstring)."""

    core: Any  # the EngineCore
    calls: Any  # its CoreCalls

    def load_lora(self, name: str, path: Union[str, Path], *,
                  where: Optional[Callable[[str], None]] = None) -> AdapterRef:
        """Load the PEFT adapter in directory `path` as `name` (again: its next version; requests
        in flight finish on the version they started with). Read and checked on the caller's thread
        (call it off the loop: a read is the disk's time), so a bad adapter raises its typed
        `LoRAError` and the engine serves on untouched; `where(real_path)` may refuse the opened
        directory (`inference.lora.files`)."""
        if not isinstance(name, str) or not name:
            raise LoRALoadError(f"lora_name must be a non-empty string, got {name!r}")
        model = self.core.model
        adapter = load_peft_adapter(str(path), name, model, max_rank=self.core.config.max_lora_rank,
                                    dtype=model.spec.dtype, device=model.device, where=where)
        return self.calls.run(self.core.add_lora, adapter)

    def load_lora_from_peft(self, name: str, peft_model: Any, adapter_name: str = "default", *,
                            share: bool = False) -> AdapterRef:
        """Load adapter `adapter_name` of a live PEFT model (a trainer's) as the next version of
        `name`: its LoRA tensors are copied as they are now (bytes of the adapter only; the base
        weights are untouched), or with `share` aliased (colocated, zero copy: the trainer's in-place
        optimizer steps are what the engine reads; call again after each step for the next version,
        whose prefix-cache blocks never match the last one's). Checked as `load_lora` checks a directory."""
        model = self.core.model
        adapter = load_live_peft_adapter(peft_model, name, model, max_rank=self.core.config.max_lora_rank,
                                         dtype=model.spec.dtype, device=model.device, adapter_name=adapter_name,
                                         share=share)
        return self.calls.run(self.core.add_lora, adapter)

    def build_lora(self, name: str, tensors: dict[str, torch.Tensor], *, alpha: float,
                   rslora: bool = False) -> LoRAAdapter:
        """An adapter of PEFT-named `tensors` (`base_model.model.<module>.lora_{A,B}.weight`: what a
        trainer's sync sends) checked against this model and `max_lora_rank`, on the caller's thread;
        typed `LoRAError`s. `add_lora` makes it resident."""
        self._check_lora_name(name)
        model = self.core.model
        return adapter_from_tensors(tensors, name, model, alpha=alpha, rslora=rslora,
                                    max_rank=self.core.config.max_lora_rank, dtype=model.spec.dtype,
                                    device=model.device)

    def check_lora_shapes(self, name: str, shapes: dict[str, tuple[int, ...]]) -> AdapterShape:
        """`build_lora`'s checks on names and shapes alone (a sync's, before a byte arrives)."""
        self._check_lora_name(name)
        return check_adapter_shapes(shapes, name, self.core.model, max_rank=self.core.config.max_lora_rank)

    @staticmethod
    def _check_lora_name(name: str) -> None:
        if not isinstance(name, str) or not name:
            raise LoRALoadError(f"lora_name must be a non-empty string, got {name!r}")

    def add_lora(self, adapter: LoRAAdapter, version: Optional[int] = None) -> AdapterRef:
        """Make `adapter` (from `build_lora`) the current version of its name: `version`, or (None)
        the next one; requests in flight finish on theirs (PIN)."""
        return self.calls.run(self.core.add_lora, adapter, version)

    def unload_lora(self, name: str) -> None:
        """Unload adapter `name`: `LoRANotFoundError`, or `LoRAInUseError` while requests use it."""
        self.calls.run(self.core.remove_lora, name)

    def list_loras(self) -> list[AdapterInfo]:
        """The loaded adapters (current versions), by name."""
        return self.calls.run(self.core.lora_infos)
