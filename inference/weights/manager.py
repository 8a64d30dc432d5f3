"""WeightManager: the policy version and how the engine's weights relate to a trainer's.

Colocated, the model's tensors alias the trainer's parameters, so a sync moves no bytes
(`refresh_from_trainer` rewrites only what an adapter had to convert). Otherwise new weights are
copied in by name, in one call (`prepare_update` checks everything, `apply_update` copies) or
staged over many (`begin_update`, any number of `load`, then `commit` or `abort`):

* `double` staging loads into copies while the old weights keep serving; commit swaps them in,
  abort drops them and nothing changed. With `retain_staging`, the weights a commit replaces are
  kept as the next update's staging buffers, so a steady stream of updates copies into warm
  memory instead of allocating (first-touch page faults made those copies ~6x slower on CPU), at
  the cost of a second copy of the weights held between updates (`drop_spare`, and `suspend`,
  free it);
* `in_place` staging loads into the live weights (no second copy): from `begin_update` until a
  complete update commits the weights are not fit to serve (`serving_error` says why), also after
  an abort, until the next complete update.

The version goes up only once the new weights are in place (`commit_version`); the engine core
then resets the prefix cache, which this class does not own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch

from inference.errors import EngineStateError, WeightNameError, WeightShapeError
from inference.models import packed_weights
from inference.weights.adapters import WeightAdapter
from inference.weights.staging import OpenUpdate, StagedUpdate, Staging

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
        # (bytes, its tensors as (tensor, offset, size, stride)) per storage freed with no copy kept
        self._discarded: list[tuple[int, list[tuple[torch.Tensor, int, tuple, tuple]]]] = []
        self._update: Optional[StagedUpdate] = None
        self._serial = 0  # the last update opened
        self._broken: Optional[str] = None  # why the live weights are mixed (an aborted in-place update)
        self._spare: dict[str, torch.Tensor] = {}  # DOUBLE staging buffers kept from the last commit

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def aliases_trainer(self) -> bool:
        return bool(self._bound_trainer_tensors)

    @property
    def serving_error(self) -> Optional[str]:
        """Why the weights cannot serve now (an in-place update is open or was aborted), or None."""
        if self._update is not None and self._update.staging is Staging.IN_PLACE:
            return f"an in-place weight update to version {self._update.opened.version} is being loaded"
        return self._broken

    @property
    def awaits_update(self) -> bool:
        """The weights cannot serve until a complete update (discarded by a deep sleep, or an
        aborted in-place update): a wait that does not end by itself, unlike an open in-place load."""
        return self._broken is not None and self.serving_error is self._broken

    @property
    def update_in_progress(self) -> bool:
        return self._update is not None

    # ---- binding -----------------------------------------------------------------------------

    def adopt_aliases(self, tensors: list[torch.Tensor]) -> None:
        """Record trainer tensors the model already aliases (`from_pretrained(share_weights=True)`)."""
        self._bound_trainer_tensors = list(tensors)

    def bind_trainer_model(self, module: Any, adapter: Optional[WeightAdapter] = None) -> Any:
        """Alias the trainer's parameters: an HF `*ForCausalLM`, or another layout through its
        `adapter` (megatron-core: `weight_sync.MEGATRON_ADAPTER`).

        Tensors whose layout or dtype prevents aliasing are copied, and the report says so.
        """
        expected = self.model.spec.weight_shapes()
        binding = None
        params = dict(module.named_parameters(remove_duplicate=False)) if hasattr(module, "config") else {}
        if params and all(n in params for n in expected):  # an HF *ForCausalLM: native names
            tensors = {n: params[n] for n in expected}
        else:
            if adapter is None:
                raise TypeError(
                    f"bind_trainer_model: {type(module).__name__} is not an HF *ForCausalLM with this model's "
                    "parameter names; pass the adapter of its layout (megatron-core: weight_sync.MEGATRON_ADAPTER)"
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

    def prepare_update(self, named_tensors: NamedTensors, *, partial: bool = False,
                       adapter: Optional[WeightAdapter] = None) -> dict[str, torch.Tensor]:
        """HF-named tensors of an update (names of another layout converted by its `adapter`),
        every name, shape and dtype checked; nothing changes.

        Raises `WeightNameError` / `WeightShapeError`, or `EngineStateError` when the model
        aliases the trainer's parameters (an update would write into them).
        """
        if self._bound_trainer_tensors:
            raise EngineStateError(
                "update_weights would write into the trainer's aliased parameters; call on_weights_updated()"
            )
        pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        localize = getattr(self.model, "localize_weights", None)
        if localize is not None:  # NOTE: an MoE rank keeps its own experts of whole-model tensors
            names = [n for n, _ in pairs]
            if len(set(names)) != len(names):
                raise WeightNameError("update_weights: a tensor name appears twice")
            pairs = list(localize(dict(pairs)).items())
        hf = self._to_hf_names(pairs, adapter)
        self._validate(hf, partial)
        return hf

    def apply_update(self, hf: dict[str, torch.Tensor]) -> None:
        """Copy checked tensors (from `prepare_update`) into the model's own weights."""
        if self._update is not None:
            raise EngineStateError("a staged weight update is open; commit() or abort() it first")
        self.model.bind_weights(hf, alias=False)  # NOTE: packs of the old weights go at commit_version
        if not self.missing_after(hf):
            self._broken = None  # a complete update makes mixed weights whole again

    def missing_after(self, hf: dict[str, torch.Tensor]) -> list[str]:
        return [n for n in self.model.spec.weight_shapes() if n not in hf]

    def check_version(self, version: Optional[int]) -> None:
        if version is not None and version <= self._version:
            raise ValueError(f"version must exceed the current policy version {self._version}, got {version}")

    def commit_version(self, version: Optional[int] = None) -> int:
        """New weights are in place: the version becomes `version` (which must exceed it) or +1."""
        self.check_version(version)
        packed_weights.forget_all()  # NOTE: packs are rebuilt from the new weights on their next use
        self._version = version if version is not None else self._version + 1
        return self._version

    def _to_hf_names(self, pairs: list[tuple[str, torch.Tensor]],
                     adapter: Optional[WeightAdapter]) -> dict[str, torch.Tensor]:
        names = [n for n, _ in pairs]
        if len(set(names)) != len(names):
            raise WeightNameError("update_weights: a tensor name appears twice")
        expected = self.model.spec.weight_shapes()
        if all(n in expected or n == "lm_head.weight" for n in names):
            return dict(pairs)
        if adapter is None:
            unknown = [n for n in names if n not in expected][:8]
            raise WeightNameError(f"update_weights: unknown tensor names {unknown} (names of another layout need "
                                  "its adapter, megatron-core's: weight_sync.MEGATRON_ADAPTER)")
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

    # ---- staged updates ----------------------------------------------------------------------

    def begin_update(self, version: Optional[int] = None, staging: Staging = Staging.DOUBLE, *,
                     partial: bool = False, retain_staging: bool = False, origin: str = "",
                     held: bool = False) -> None:
        """Open a staged update to `version` (default: current + 1 at commit). With `partial`,
        commit accepts a subset of the tensors; otherwise every tensor must be loaded first.
        `retain_staging` (double only): keep the replaced weights as the next update's buffers.
        `origin` and `held` are its feeder's to read back (`open_update`)."""
        staging = Staging(staging)
        if self._update is not None:
            raise EngineStateError("a weight update is already open; commit() or abort() it first")
        if self._bound_trainer_tensors:
            raise EngineStateError("the engine aliases the trainer's parameters; call on_weights_updated()")
        if self._offloaded:
            raise EngineStateError("the engine's weights are offloaded (suspended); resume() first")
        self.check_version(version)
        self._serial += 1
        self._update = StagedUpdate(OpenUpdate(self._serial, version, origin, held), staging, partial,
                                    retain_staging and staging is Staging.DOUBLE)

    def open_update(self) -> Optional[OpenUpdate]:
        """The open update's view (None: none is open)."""
        update = self._update
        return None if update is None else update.opened

    def staging_buffers(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Buffers the engine owns, by HF name, for a transport to write the open `double` update
        into directly; a later `load` of one of these very tensors adopts it without a copy.
        Spare buffers are reused (warm). Refused for `in_place` updates, for names the model does
        not hold as such (another layout, a tied LM head) and when the model keeps a share of
        each tensor (an MoE rank): `load` copies those."""
        update = self._update
        if update is None or update.staging is not Staging.DOUBLE:
            raise EngineStateError("staging_buffers() needs an open double-staged update")
        if getattr(self.model, "localize_weights", None) is not None:
            raise EngineStateError("this model keeps a share of each tensor: load() the whole tensors")
        expected = self.model.spec.weight_shapes()
        names = list(names)
        unknown = [n for n in names if n not in expected]
        if unknown:
            raise WeightNameError(f"staging_buffers: not tensors of this model as named: {unknown[:8]}")
        device, dtype = self.model.device, self.model.spec.dtype
        out = {}
        for name in names:
            buf = update.handed.get(name)
            if buf is None:
                spare = self._spare.pop(name, None)
                fits = spare is not None and tuple(spare.shape) == expected[name] and spare.dtype == dtype
                buf = spare if fits else torch.empty(expected[name], dtype=dtype, device=device)
                update.handed[name] = buf
            out[name] = buf
        return out

    def load(self, named_tensors: NamedTensors, adapter: Optional[WeightAdapter] = None) -> int:
        """Load a bucket of tensors into the open update; returns how many names are loaded so far.

        Every name, shape and dtype of the bucket is checked before any of it is written; a name
        loaded twice is refused. On an error the update stays open (abort it, or load again).
        A tensor that is the buffer `staging_buffers` handed out for its name is adopted as is.
        """
        update = self._update
        if update is None:
            raise EngineStateError("load() without begin_update()")
        hf = self.prepare_update(named_tensors, partial=True, adapter=adapter)
        again = sorted(set(hf) & update.loaded)
        if again:
            raise WeightNameError(f"load: tensors loaded twice in one update: {again[:8]}")
        if update.staging is Staging.DOUBLE:
            for name, tensor in hf.items():
                handed = update.handed.pop(name, None)
                if handed is tensor:
                    update.staged[name] = tensor  # NOTE: the transport wrote it: nothing to copy
                    continue
                if handed is not None:
                    self._spare[name] = handed
                update.staged[name] = self._staging_copy(name, tensor)
        else:
            self.model.bind_weights(hf, alias=False)
        update.loaded.update(hf)
        return len(update.loaded)

    def _staging_copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` copied into a spare buffer when one fits, else into a new one."""
        device, dtype = self.model.device, self.model.spec.dtype
        spare = self._spare.pop(name, None)
        if spare is not None and spare.shape == tensor.shape:
            with torch.no_grad():
                return spare.copy_(tensor)
        return tensor.detach().to(device, dtype, copy=True)

    def drop_spare(self) -> int:
        """Free the staging buffers kept for the next update; the bytes freed."""
        freed = self.spare_bytes()
        self._spare = {}
        return freed

    def spare_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._spare.values())

    def missing_from_update(self) -> list[str]:
        update = self._update
        if update is None or update.partial:
            return []
        spec = self.model.spec
        return [n for n in spec.weight_shapes() if n not in update.loaded]

    def commit_update(self) -> int:
        """Put the loaded tensors in place and commit the version; returns it. Refused (update
        still open) when tensors are missing from a complete update."""
        update = self._update
        if update is None:
            raise EngineStateError("commit() without begin_update()")
        missing = self.missing_from_update()
        if missing:
            raise WeightNameError(f"commit: {len(missing)} tensors not loaded, e.g. {missing[:8]}")
        if update.staging is Staging.DOUBLE and update.staged:
            live = self.model.named_tensors()
            retired = {n: live[n] for n in update.staged if n in live}
            self.model.bind_weights(update.staged, alias=True)  # NOTE: a swap: the copies become the weights
            # NOTE: the replaced tensors are the engine's own (begin refuses aliased trainer weights)
            self._spare = retired if update.retain_staging else {}
        if update.retain_staging:
            self._spare.update(update.handed)  # NOTE: handed out, never loaded (a partial update)
        self._update = None
        self._broken = None
        return self.commit_version(update.opened.version)

    def abort_update(self) -> None:
        """Drop the open update. `double`: nothing changed. `in_place` after a load: the live weights
        are mixed and refuse to serve until a complete update commits."""
        update, self._update = self._update, None
        if update is None:
            return
        if update.retain_staging:
            self._spare.update(update.staged)  # NOTE: buffers, whatever they hold now
            self._spare.update(update.handed)
        if update.staging is Staging.IN_PLACE and update.loaded:
            self._broken = (f"an in-place update was aborted after {len(update.loaded)} tensors were written: the "
                            "weights are mixed; load a complete update to serve again")
            logger.warning(self._broken)

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
        packed_weights.forget_all()  # NOTE: a suspend frees the packs too
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

    def discard(self) -> int:
        """Free the engine's own weight storage without keeping a copy (vLLM's sleep level 2: the
        trainer sends new weights anyway). After `restore` the tensors hold no weights until a
        complete update (`serving_error` says so). Returns the bytes freed; a no-op when already.

        NOTE: every tensor on a storage is pointed at an empty one (`set_`), so weights a
        checkpoint maps from disk (not resizable) are freed too, and tied weights stay tied."""
        if self._discarded or self._offloaded:
            return 0
        packed_weights.forget_all()
        aliased = {t.untyped_storage().data_ptr() for t in self._bound_trainer_tensors}
        groups: dict[int, list[torch.Tensor]] = {}
        for tensor in self.model.named_tensors().values():
            ptr = tensor.untyped_storage().data_ptr()
            if ptr not in aliased and tensor.numel():
                groups.setdefault(ptr, []).append(tensor)
        for members in groups.values():
            nbytes = members[0].untyped_storage().nbytes()
            views = [(t, t.storage_offset(), tuple(t.size()), t.stride()) for t in members]
            empty = torch.empty(0, dtype=torch.uint8, device=members[0].device).untyped_storage()
            for t, *_ in views:
                t.set_(empty, 0, (0,), (1,))
            self._discarded.append((nbytes, views))
        return self.discarded_bytes()

    def discarded_bytes(self) -> int:
        return sum(nbytes for nbytes, _ in self._discarded)

    def restore(self) -> None:
        """Bring offloaded weights back into their tensors, and give discarded ones their storage
        again (no weights in it: serving is refused until a complete update); a no-op when none
        are away.

        On an allocation failure the tensors restored so far are offloaded again, so the
        weights are either all back or all still on host.
        """
        done = []
        try:
            for name, host, tensor in self._offloaded:
                tensor.untyped_storage().resize_(host.numel() * host.element_size())
                tensor.copy_(host)
                done.append((name, host, tensor))
            for nbytes, views in self._discarded:
                storage = torch.empty(nbytes, dtype=torch.uint8, device=views[0][0].device).untyped_storage()
                for t, offset, size, stride in views:
                    t.set_(storage, offset, size, stride)
        except (RuntimeError, MemoryError):
            for _, _, tensor in done:
                tensor.untyped_storage().resize_(0)
            raise
        self._offloaded = []
        if self._discarded:
            self._discarded = []
            self._broken = ("the weights were discarded by a deep sleep (level 2); a complete weight update "
                            "must load them before the engine generates")
