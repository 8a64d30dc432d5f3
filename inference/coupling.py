"""Trainer coupling: suspend / resume around training steps, weight binding and updates.

Mixed into `DynamicInferenceEngine`. Colocated, the engine frees its KV buffer (and optionally
its own weights) while the trainer steps, and takes them back after. Weights either alias the
trainer's parameters (a sync moves no bytes: `on_weights_updated()`) or are copied in
(`update_weights`). Either way the policy version goes up only once the new weights are in
place, and the prefix cache never serves a block computed under an older version.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from inference.config import InFlightPolicy
from inference.errors import EngineStateError, ResumeMemoryError, WeightNameError, WeightShapeError
from inference.request import FinishReason, RequestOutput
from inference.weight_adapters import adapter_for_module, adapter_for_names

logger = logging.getLogger(__name__)


def process_rss_bytes() -> int:
    """Resident set size of this process (Linux), the CPU measure of memory in use."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available_device_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device` (free GPU memory, or MemAvailable on CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _memory_in_use(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else process_rss_bytes()


@dataclass(frozen=True, slots=True)
class SuspendReport:
    """What a suspend did: bytes freed as measured (RSS on CPU, allocated memory on GPU)."""

    buffer_bytes: int  # KV (and state) buffer bytes that were allocated
    offloaded_weight_bytes: int
    measured_freed_bytes: int
    requests_aborted: int
    requests_to_recompute: int
    requests_offloaded: int


class TrainerCoupling:
    """Suspend/resume and weight-update half of the engine (see module docstring)."""

    # ---- versions ----------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self.context.policy_version

    def reset_prefix_cache(self) -> None:
        """Nothing cached so far can be matched again, even blocks requests still hold."""
        self.allocator.reset_prefix_cache()
        self.context.cache_broken[:] = True  # in-flight chains may not register under a new version

    # ---- suspend / resume --------------------------------------------------------------------

    def suspend(self, in_flight: Optional[InFlightPolicy] = None, *, offload_weights: bool = False) -> SuspendReport:
        """Free the KV buffer (and, if asked, the engine's own weights) for the trainer.

        In-flight requests follow `in_flight` (default: the config's): ABORT finishes them,
        RECOMPUTE queues them to be prefilled again on resume, OFFLOAD copies their KV blocks
        to host memory and restores them on resume. A second suspend is a no-op.
        """
        from inference.engine import EngineState

        if self.state is EngineState.SUSPENDED:
            return SuspendReport(0, 0, 0, 0, 0, 0)
        if self.state is not EngineState.RUNNING:
            raise EngineStateError(f"cannot suspend while {self.state.value}")
        policy = InFlightPolicy(in_flight or self.config.in_flight_policy)
        if policy is InFlightPolicy.KEEP:
            raise ValueError("in_flight: KEEP applies to weight updates; suspend takes ABORT, RECOMPUTE or OFFLOAD")
        self.state = EngineState.SUSPENDING
        device = self.kv_cache.device
        before = _memory_in_use(device)
        aborted = requeued = offloaded = 0
        if policy is InFlightPolicy.ABORT:
            aborted = self._abort_all()
        elif policy is InFlightPolicy.RECOMPUTE:
            requeued = self._requeue_in_slot_requests()
        else:
            offloaded = self._offload_in_slot_requests()
        self.allocator.reset()  # the buffer's contents are about to go: so is every cached block
        buffer_bytes = self.kv_cache.nbytes
        self.kv_cache.deallocate()
        self.model.backend.release_workspace()  # attention's reusable gather buffers are KV-sized too
        weight_bytes = self._offload_weights() if offload_weights else 0
        freed = max(0, before - _memory_in_use(device))
        self.state = EngineState.SUSPENDED
        report = SuspendReport(buffer_bytes, weight_bytes, freed, aborted, requeued, offloaded)
        logger.info("suspended: %s", report)
        return report

    def resume(self) -> None:
        """Re-allocate what suspend freed; raises `ResumeMemoryError` (still suspended) if it can't."""
        from inference.engine import EngineState

        if self.state is not EngineState.SUSPENDED:
            raise EngineStateError(f"resume() without suspend(): the engine is {self.state.value}")
        self.state = EngineState.RESUMING
        device = self.kv_cache.device
        needed = self.kv_cache.nbytes + sum(t.numel() * t.element_size() for _, t, _ in self._offloaded_weights)
        free = available_device_memory(device)
        if needed > free:
            self.state = EngineState.SUSPENDED
            raise ResumeMemoryError(f"resume needs {needed} bytes on {device}, {free} available; still suspended")
        try:
            self._restore_weights()
            self.kv_cache.allocate()
        except (RuntimeError, MemoryError, OSError) as exc:  # an allocation failed: undo, stay suspended
            self.kv_cache.deallocate()
            self._offload_weights()
            self.state = EngineState.SUSPENDED
            raise ResumeMemoryError(f"resume could not allocate its buffers ({exc}); still suspended") from exc
        self._restore_offloaded_requests()
        self.state = EngineState.RUNNING

    def _abort_all(self) -> int:
        ctx, sched = self.context, self.scheduler
        for slot in list(ctx.active) + list(ctx.paused):
            ctx.release_memory_blocks_from_request_indexes([slot])
        sched.waiting.clear()
        sched.reserved_slots = 0
        live = sorted(self._live.values(), key=lambda r: r.request_id)
        for req in live:
            req.fork_children = []
            self._finish(req, FinishReason.ABORT)
            self._unclaimed.append(RequestOutput.from_request(req))
        return len(live)

    def _requeue_in_slot_requests(self) -> int:
        """Move every request in a slot back to the waiting queue's front, oldest first."""
        ctx, sched = self.context, self.scheduler
        slots = sorted(ctx.active + ctx.paused, key=lambda s: ctx.requests[s].request_id)
        requests = ctx.release_memory_blocks_from_request_indexes(slots)
        for req in reversed(requests):
            sched.reserved_slots -= len(req.fork_children)
            sched.add(req, front=True)
        return len(requests)

    def _offload_in_slot_requests(self) -> int:
        """Copy the blocks of every request in a slot to host memory; slots stay as they are."""
        ctx = self.context
        slots = ctx.active + ctx.paused
        if not slots:
            self._offloaded_kv = None
            return 0
        held = np.unique(np.concatenate([ctx.block_table[s, : ctx.num_blocks[s]] for s in slots]))
        self._offloaded_kv = (held, self.kv_cache.offload(held.tolist()))
        return len(slots)

    def _restore_offloaded_requests(self) -> None:
        saved, self._offloaded_kv = self._offloaded_kv, None
        if saved is None:
            return
        held, host = saved
        ctx = self.context
        fresh = np.array(self.allocator.allocate(held.size), dtype=np.int64)
        new_id = np.full(self.allocator.total, -1, dtype=np.int64)
        new_id[held] = fresh
        holders = []
        for slot in ctx.active + ctx.paused:
            n = int(ctx.num_blocks[slot])
            ctx.block_table[slot, :n] = new_id[ctx.block_table[slot, :n]]
            holders.append(ctx.block_table[slot, :n])
        counts = np.bincount(np.concatenate(holders), minlength=self.allocator.total)
        extra = np.repeat(np.arange(counts.size), np.maximum(counts - 1, 0))
        if extra.size:
            self.allocator.retain(extra.tolist())  # blocks shared by a group: one reference per holder
        self.kv_cache.restore(fresh.tolist(), host)
        ctx.cache_broken[ctx.active + ctx.paused] = True  # their chains left the registry at suspend

    def _offload_weights(self) -> int:
        """Move the engine's own weight storage to host memory (aliased trainer tensors stay)."""
        if self._offloaded_weights:
            return 0
        aliased = {t.data_ptr() for t in self._bound_trainer_tensors}
        seen, moved, total = set(), [], 0
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
            total += host.numel() * host.element_size()
        self._offloaded_weights = moved
        return total

    def _restore_weights(self) -> None:
        for _, host, tensor in self._offloaded_weights:
            tensor.untyped_storage().resize_(host.numel() * host.element_size())
            tensor.copy_(host)
        self._offloaded_weights = []

    # ---- weights -----------------------------------------------------------------------------

    def bind_trainer_model(self, module: Any) -> Any:
        """Alias the trainer's parameters (HF `*ForCausalLM`, or megatron-core via `weight_sync`).

        Tensors whose layout or dtype prevents aliasing are copied, and the model says so loudly;
        call `on_weights_updated()` after each optimizer step (no bytes move for aliased ones).
        Returns the bind report (aliased / copied names with reasons).
        """
        spec = self.model.spec
        expected = spec.weight_shapes()
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
            binding = adapter.module_to_hf(module, spec)
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
        self.reset_prefix_cache()
        return report

    def on_weights_updated(self, in_flight: Optional[InFlightPolicy] = None) -> int:
        """The aliased weights changed in place (optimizer step): new version, prefix cache reset.

        Tensors an adapter had to convert (not aliasable) are refreshed from the trainer first.
        """
        if self._trainer_refresh is not None:
            self._trainer_refresh()
        self._apply_update_policy(in_flight)
        self.context.policy_version += 1
        self.reset_prefix_cache()
        return self.context.policy_version

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: Optional[int] = None,
        *,
        in_flight: Optional[InFlightPolicy] = None,
        partial: bool = False,
    ) -> int:
        """Copy new weights in (HF or megatron-core names); commit them under a new version.

        Names, shapes and dtypes are all checked before any byte is copied: on a typed error the
        old weights are intact and nothing changed. `partial=True` accepts a subset of tensors.
        Returns the new policy version (`version`, which must exceed the current one, or +1).
        """
        if self._bound_trainer_tensors:
            raise EngineStateError(
                "update_weights would write into the trainer's aliased parameters; call on_weights_updated()"
            )
        pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        hf = self._to_hf_names(pairs)
        self._validate_update(hf, partial)
        if version is not None and version <= self.context.policy_version:
            raise ValueError(f"version must exceed the current policy version {self.context.policy_version}, "
                             f"got {version}")
        self._apply_update_policy(in_flight)
        self.model.bind_weights(hf, alias=False)
        self.context.policy_version = version if version is not None else self.context.policy_version + 1
        self.reset_prefix_cache()
        return self.context.policy_version

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

    def _validate_update(self, hf: dict[str, torch.Tensor], partial: bool) -> None:
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

    def _apply_update_policy(self, in_flight: Optional[InFlightPolicy]) -> None:
        default = self.config.in_flight_policy
        if default is InFlightPolicy.OFFLOAD:  # a suspend-only policy: updates recompute instead
            default = InFlightPolicy.RECOMPUTE
        policy = InFlightPolicy(in_flight or default)
        if policy is InFlightPolicy.ABORT:
            self._abort_all()
        elif policy is InFlightPolicy.RECOMPUTE:
            self._requeue_in_slot_requests()
        elif policy is InFlightPolicy.OFFLOAD:
            raise ValueError("in_flight: OFFLOAD applies to suspend; a weight update takes ABORT, RECOMPUTE or KEEP")
        # KEEP: requests go on with their KV; their next tokens carry the new version

