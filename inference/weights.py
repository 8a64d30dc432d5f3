"""WeightManager: the policy version and how the engine's weights relate to a trainer's.

Colocated, the model's tensors alias the trainer's parameters, so a sync moves no bytes
(`refresh_from_trainer` rewrites only what an adapter had to convert). Otherwise new weights are
copied in by name (`prepare_update` checks everything, `apply_update` copies). The version goes
up only once the new weights are in place (`commit_version`); the engine core then resets the
prefix cache, which this class does not own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch

from inference.errors import EngineStateError, WeightNameError, WeightShapeError
from inference.weight_adapters import adapter_for_module, adapter_for_names

logger = logging.getLogger(__name__)

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class WeightManager:
    """Sole owner of `policy_version`, the trainer binding and the engine's own weight storage.

    Invariants: `policy_version` never decreases; tensors aliasing the trainer's are never
    written (`apply_update` refuses) nor freed (`offload` skips them).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._version = 0
        self._bound_trainer_tensors: list[torch.Tensor] = []  # the trainer's tensors the model aliases
        self._trainer_refresh = None  # rewrites tensors an adapter had to convert
        self._offloaded: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # (name, host copy, tensor)

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def aliases_trainer(self) -> bool:
        return bool(self._bound_trainer_tensors)

    # ---- binding -----------------------------------------------------------------------------

    def adopt_aliases(self, tensors: list[torch.Tensor]) -> None:
        """Record trainer tensors the model already aliases (`from_pretrained(share_weights=True)`)."""
        self._bound_trainer_tensors = list(tensors)

    def bind_trainer_model(self, module: Any) -> Any:
        """Alias the trainer's parameters (HF `*ForCausalLM`, or megatron-core via `weight_sync`).

        Tensors whose layout or dtype prevents aliasing are copied, and the report says so.
        """
        expected = self.model.spec.weight_shapes()
        binding = None
        params = dict(module.named_parameters(remove_duplicate=False)) if hasattr(module, "config") else {}
        if params and all(n in params for n in expected):  # an HF *ForCausalLM: native names
            tensors = {n: params[n] for n in expected}
        else:
            adapter = adapter_for_module(module)
            if adapter is None:
                raise TypeError(
                    f"bind_trainer_model: {type(module).__name__} is neither an HF *ForCausalLM with this "
                    "model's parameter names nor a layout with a registered adapter (`import weight_sync` "
                    "registers megatron-core's)"
                )
            binding = adapter.module_to_hf(module, self.model.spec)
            tensors = dict(binding)
        report = self.model.bind_weights(tensors, alias=True)
        # NOTE: an adapter may have had to convert some tensors (megatron's interleaved QKV with
        # several query groups); the engine aliases those copies, which `refresh` rewrites in place.
        converted = dict(getattr(binding, "copied", {}))
        for name, reason in converted.items():
            if name in report.aliased:
                report.aliased.remove(name)
            report.copied[name] = f"converted from the trainer's layout: {reason}"
        self._trainer_refresh = getattr(binding, "refresh", None) if converted else None
        self._bound_trainer_tensors = [tensors[n] for n in report.aliased] + [tensors[n] for n in converted]
        return report

    def refresh_from_trainer(self) -> None:
        """The trainer stepped in place: rewrite the tensors an adapter had to convert."""
        if self._trainer_refresh is not None:
            self._trainer_refresh()

    # ---- copied updates ----------------------------------------------------------------------

    def prepare_update(self, named_tensors: NamedTensors, *, partial: bool = False) -> dict[str, torch.Tensor]:
        """HF-named tensors of an update, every name, shape and dtype checked; nothing changes.

        Raises `WeightNameError` / `WeightShapeError`, or `EngineStateError` when the model
        aliases the trainer's parameters (an update would write into them).
        """
        if self._bound_trainer_tensors:
            raise EngineStateError(
                "update_weights would write into the trainer's aliased parameters; call on_weights_updated()"
            )
        pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        hf = self._to_hf_names(pairs)
        self._validate(hf, partial)
        return hf

    def apply_update(self, hf: dict[str, torch.Tensor]) -> None:
        """Copy checked tensors (from `prepare_update`) into the model's own weights."""
        self.model.bind_weights(hf, alias=False)

    def check_version(self, version: Optional[int]) -> None:
        if version is not None and version <= self._version:
            raise ValueError(f"version must exceed the current policy version {self._version}, got {version}")

    def commit_version(self, version: Optional[int] = None) -> int:
        """New weights are in place: the version becomes `version` (which must exceed it) or +1."""
        self.check_version(version)
        self._version = version if version is not None else self._version + 1
        return self._version

    def _to_hf_names(self, pairs: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        names = [n for n, _ in pairs]
        if len(set(names)) != len(names):
            raise WeightNameError("update_weights: a tensor name appears twice")
        expected = self.model.spec.weight_shapes()
        if all(n in expected or n == "lm_head.weight" for n in names):
            return dict(pairs)
        adapter = adapter_for_names(names)
        if adapter is None:
            unknown = [n for n in names if n not in expected][:8]
            raise WeightNameError(f"update_weights: unknown tensor names {unknown}")
        return dict(adapter.names_to_hf(dict(pairs), self.model.spec))

    def _validate(self, hf: dict[str, torch.Tensor], partial: bool) -> None:
        spec = self.model.spec
        expected = spec.weight_shapes()
        unknown = [n for n in hf if n not in expected and not (n == "lm_head.weight" and spec.tie_word_embeddings)]
        if unknown:
            raise WeightNameError(f"update_weights: unknown tensor names {unknown[:8]}")
        missing = [n for n in expected if n not in hf]
        if missing and not partial:
            raise WeightNameError(f"update_weights: missing tensors {missing[:8]} (pass partial=True for a subset)")
        for name, tensor in hf.items():
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise WeightShapeError(f"update_weights: {name} must be a floating-point tensor, got "
                                       f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
            if name in expected and tuple(tensor.shape) != expected[name]:
                raise WeightShapeError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                       f"expected {expected[name]}")

    # ---- offload (suspend) -------------------------------------------------------------------

    @property
    def offloaded(self) -> bool:
        return bool(self._offloaded)

    def offloaded_bytes(self) -> int:
        return sum(host.numel() * host.element_size() for _, host, _ in self._offloaded)

    def offload(self) -> int:
        """Move the engine's own weight storage to host memory (aliased trainer tensors stay).

        Returns the bytes moved; a no-op when already offloaded.
        """
        if self._offloaded:
            return 0
        aliased = {t.data_ptr() for t in self._bound_trainer_tensors}
        seen, moved = set(), []
        for name, tensor in self.model.named_tensors().items():
            ptr = tensor.data_ptr()
            if ptr in aliased or ptr in seen or tensor.numel() == 0:
                continue
            seen.add(ptr)
            host = tensor.detach().to("cpu", copy=True)  # NOTE: a real copy out, on a CPU device too
            try:
                tensor.untyped_storage().resize_(0)
            except RuntimeError as exc:
                logger.warning("offload_weights: %s cannot be freed (%s); kept in place", name, exc)
                continue
            moved.append((name, host, tensor))
        self._offloaded = moved
        return self.offloaded_bytes()

    def restore(self) -> None:
        """Bring offloaded weights back into their tensors; a no-op when none are offloaded.

        On an allocation failure the tensors restored so far are offloaded again, so the
        weights are either all back or all still on host.
        """
        done = []
        try:
            for name, host, tensor in self._offloaded:
                tensor.untyped_storage().resize_(host.numel() * host.element_size())
                tensor.copy_(host)
                done.append((name, host, tensor))
        except (RuntimeError, MemoryError):
            for _, _, tensor in done:
                tensor.untyped_storage().resize_(0)
            raise
        self._offloaded = []
