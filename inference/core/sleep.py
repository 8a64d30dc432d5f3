"""Suspend and resume of one engine's memory, by part (`MEMORY_TAGS`): what sleeps now and what a
suspend took to host with the requests it kept. `EngineCore` owns the engine's state machine (it is
SUSPENDED while any part sleeps); this asks the core's parts to release and re-acquire what they hold.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any, Optional

from inference.cache.manager import OffloadedCaches
from inference.config import SuspendPolicy
from inference.core.memory import SuspendReport, available_device_memory, memory_in_use
from inference.core.states import MemoryTag, memory_parts
from inference.errors import ResumeMemoryError
from inference.sched import offload

logger = logging.getLogger(__name__)


class Sleep:
    """The parts asleep (`asleep`, the `MEMORY_TAGS` suspended now) and the requests a suspend kept
    on host (`offloaded`): the only writer of both."""

    def __init__(self, core: Any) -> None:
        self.core = core  # NOTE: the EngineCore whose parts it asks (typed loosely: it imports this module)
        self.asleep: set[MemoryTag] = set()
        self.offloaded: Optional[OffloadedCaches] = None

    def suspend(self, policy: Optional[SuspendPolicy] = None, *, offload_weights: bool = False,
                tags: Optional[Collection[str]] = None, discard_weights: bool = False) -> SuspendReport:
        """Free memory for a colocated trainer, by part (`MEMORY_TAGS`): `kv_cache` (the KV and
        state buffers, the step workspaces) and `weights` (the engine's own weight storage, moved
        to host, or with `discard_weights` dropped: vLLM's sleep level 2). `tags` None: the KV
        cache, and the weights too with `offload_weights` or `discard_weights`.

        Each part sleeps once: a part already asleep is left as it is (a no-op when all are). The
        first part to sleep suspends the engine; in-flight requests follow `policy` (default: the
        config's; OFFLOAD keeps them in place while their KV stays).
        """
        core = self.core
        parts = memory_parts(tags, offload_weights or discard_weights)
        new = parts - self.asleep
        if not new:
            return SuspendReport.nothing()
        policy = SuspendPolicy(policy or core.config.suspend_policy)
        device = core.kv_cache.device
        before = memory_in_use(device)
        aborted = requeued = offloaded = 0
        if not self.asleep:  # NOTE: the first part asleep stops generation; requests follow the policy
            if policy is SuspendPolicy.ABORT:
                aborted = core.abort_all()
            elif policy is SuspendPolicy.RECOMPUTE:
                requeued = core.scheduler.requeue_in_slot_requests()
            elif MemoryTag.KV_CACHE in new:
                offloaded = self._offload_in_slot_requests()
        buffer_bytes = workspace = weight_bytes = 0
        if MemoryTag.KV_CACHE in new:
            if self.asleep and policy is SuspendPolicy.OFFLOAD and self.offloaded is None:
                offloaded = self._offload_in_slot_requests()  # NOTE: kept in place while the KV stayed
            buffer_bytes = core.caches.release()  # every cached block goes with the buffers
            workspace = core.runner.release_workspace()  # CUDA graphs and their memory pool too
        if MemoryTag.WEIGHTS in new:
            weight_bytes = core.weights.discard() if discard_weights else core.weights.offload()
            weight_bytes += core.lora_offload.offload(core.loras.resident())  # NOTE: to host at either level
        core.weights.drop_spare()  # NOTE: spare staging buffers are the trainer's memory now too
        freed = max(0, before - memory_in_use(device))
        self.asleep |= new
        report = SuspendReport(buffer_bytes, workspace, weight_bytes, freed, aborted, requeued, offloaded)
        logger.info("suspended %s: %s", sorted(new), report)
        return report

    def resume(self, tags: Optional[Collection[str]] = None) -> bool:
        """Re-allocate what suspend freed, by part (`tags` None: all that sleeps; a part awake
        already is left as it is); whether any part woke. Raises `ResumeMemoryError` (nothing woken)
        if the memory is not there."""
        core = self.core
        if not self.asleep:
            memory_parts(tags, False)  # NOTE: still refuses an unknown tag
            return False
        wake = set(self.asleep) if tags is None else memory_parts(tags, False) & self.asleep
        if not wake:
            return False
        device = core.kv_cache.device
        needed = (core.caches.nbytes if MemoryTag.KV_CACHE in wake else 0) + (
            core.weights.offloaded_bytes() + core.weights.discarded_bytes() + core.lora_offload.nbytes
            if MemoryTag.WEIGHTS in wake else 0)
        free = available_device_memory(device)
        if needed > free:
            raise ResumeMemoryError(f"resume needs {needed} bytes on {device}, {free} available; still suspended")
        if MemoryTag.WEIGHTS in wake:
            try:
                core.weights.restore()
                core.lora_offload.restore()
            except (RuntimeError, MemoryError, OSError) as exc:
                if core.lora_offload.nbytes:  # NOTE: the adapters' restore failed: the weights go back too
                    core.weights.offload()
                raise ResumeMemoryError(f"resume could not allocate the weights ({exc}); still suspended") from exc
        if MemoryTag.KV_CACHE in wake:
            try:
                core.caches.reacquire()
            except (RuntimeError, MemoryError, OSError) as exc:  # an allocation failed: undo, stay suspended
                if MemoryTag.WEIGHTS in wake and MemoryTag.WEIGHTS in self.asleep:
                    core.weights.offload()
                raise ResumeMemoryError(f"resume could not allocate its buffers ({exc}); still suspended") from exc
            self._restore_offloaded_requests()
        self.asleep -= wake
        if not self.asleep:
            core.runner.reacquire()  # CUDA graphs captured again, over the weights and buffers both back
        return True

    def _offload_in_slot_requests(self) -> int:
        """Copy what every request in a slot holds (KV blocks, state) to host; slots stay as they are."""
        core = self.core
        ctx = core.context
        held = offload.held_block_ids(ctx)
        if held.size:
            self.offloaded = core.caches.offload(held, ctx.held_state_slots())
            offload.detach_blocks(ctx)  # NOTE: the pool reset that follows takes their references
        return len(ctx.active) + len(ctx.paused)

    def _restore_offloaded_requests(self) -> None:
        core = self.core
        saved, self.offloaded = self.offloaded, None
        if saved is not None:
            fresh, rows = offload.reattach_blocks(core.context, saved.block_ids)
            core.caches.restore(saved, fresh, rows)
