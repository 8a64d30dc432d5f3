"""CacheManager: the caches a model declares, built, sized, released and restored as one.

From the model's `cache_specs()`: a paged KV buffer with its block allocator and prefix cache
(for the attention layers), a `StatePool` of per-request slots (for recurrent layers) and, with
prefix caching, `StateSnapshots` of that state at cached block boundaries. The
scheduler's context hands out blocks and state slots through the allocator and the pool; the
manager owns the memory behind them: what suspend releases and resume re-acquires, what a fork
copies, what OFFLOAD saves to host, and how many bytes all of it takes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from inference.cache.kv_buffer import KVCacheBuffer
from inference.cache.snapshots import StateSnapshots
from inference.cache.specs import CacheSpec, KVCacheSpec, StateSpec
from inference.cache.state_pool import StatePool
from inference.config import InferenceConfig
from inference.kv_cache.allocator import KVBlockAllocator
from inference.kv_cache.events import KVEventHub

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class OffloadedCaches:
    """Host copies of what in-flight requests held when the engine suspended under OFFLOAD."""

    block_ids: np.ndarray  # sorted ids the KV blocks had
    kv: Optional[torch.Tensor]
    state_slots: list[int]
    states: Optional[dict[str, torch.Tensor]]


class CacheManager:
    """Owns the cache memory of one engine (see module docstring).

    Invariants: `kv`, `states` and `snapshots` are allocated together or released together. When
    the model declares a state pool, a KV prefix is only served together with a state snapshot
    at its end (`snapshots`, see `StateSnapshots`); with a snapshot budget of 0, KV prefix
    matching is off and `prefix_caching_disabled_reason` says so. A prefix-cache reset or release
    drops the snapshots with the blocks (the registry's reset fires no callback: this class
    clears them itself).
    """

    def __init__(self, specs: Sequence[CacheSpec], config: InferenceConfig, device: torch.device, *,
                 scratch_block: bool = False) -> None:
        kv_specs = [s for s in specs if isinstance(s, KVCacheSpec)]
        state_specs = [s for s in specs if isinstance(s, StateSpec)]
        if len(kv_specs) != 1 or len(kv_specs) + len(state_specs) != len(specs):
            raise ValueError(f"a model declares exactly one KVCacheSpec and any StateSpecs, got {list(specs)}")
        self.kv_spec = kv_specs[0]
        self.block_size = config.block_size
        num_blocks = config.resolve_num_blocks(self.kv_spec.bytes_per_block(config.block_size))
        # NOTE: with batch padding, padded rows write their K/V into one extra block nobody owns
        self.scratch_block: Optional[int] = num_blocks if scratch_block else None
        s = self.kv_spec
        self.kv = KVCacheBuffer(s.num_layers, num_blocks + int(scratch_block), config.block_size, s.num_kv_heads,
                                s.head_dim, s.dtype, device, resident=config.prefault_kv)
        self.prefix_caching_disabled_reason: Optional[str] = None
        enable_prefix = config.enable_prefix_caching
        snapshot_slots = 0
        if state_specs and enable_prefix:
            snapshot_slots = config.resolve_state_snapshot_slots(sum(s.bytes_per_slot for s in state_specs))
            if snapshot_slots == 0:
                enable_prefix = False
                self.prefix_caching_disabled_reason = (
                    "the model keeps per-request state and the state-snapshot budget is 0: a KV prefix hit "
                    "would skip the state of the prefix")
                logger.info("prefix caching off: %s", self.prefix_caching_disabled_reason)
        self.allocator = KVBlockAllocator(num_blocks, config.block_size, config.eviction_policy, enable_prefix,
                                          KVEventHub(record=config.record_kv_events))
        self.states = StatePool(state_specs, config.max_requests, device) if state_specs else None
        # the Mamba side of the prefix cache: the state at cached block boundaries
        self.snapshots = (StateSnapshots(state_specs, snapshot_slots, device, self.allocator.registry)
                          if state_specs and enable_prefix else None)

    # ---- memory ------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of all cache buffers when allocated."""
        return (self.kv.nbytes + (self.states.nbytes if self.states is not None else 0)
                + (self.snapshots.nbytes if self.snapshots is not None else 0))

    @property
    def is_allocated(self) -> bool:
        return self.kv.is_allocated

    def release(self) -> int:
        """Drop the buffers (suspend); every cached block goes with them. Returns their bytes."""
        freed = self.nbytes
        self.allocator.reset()
        self.kv.deallocate()
        if self.states is not None:
            self.states.deallocate()
        if self.snapshots is not None:
            self.snapshots.deallocate()
        if self.kv.device.type == "cuda":
            torch.cuda.empty_cache()
        return freed

    def reacquire(self) -> None:
        """Allocate the buffers again (resume); on failure nothing stays allocated."""
        try:
            self.kv.allocate()
            if self.states is not None:
                self.states.allocate()
            if self.snapshots is not None:
                self.snapshots.allocate()
        except BaseException:
            self.kv.deallocate()
            if self.states is not None:
                self.states.deallocate()
            if self.snapshots is not None:
                self.snapshots.deallocate()
            raise

    def reset_prefix_cache(self) -> None:
        """Nothing cached so far can be matched again: KV blocks and state snapshots."""
        self.allocator.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.clear()

    # ---- in-flight requests ------------------------------------------------------------------

    def copy_for_forks(self, kv_pairs: Sequence[tuple[int, int]], state_pairs: Sequence[tuple[int, int]]) -> None:
        """Forked samples get their own copy of the parent's partial KV block and of its state."""
        if kv_pairs:
            src, dst = zip(*kv_pairs)
            self.kv.copy_blocks(list(src), list(dst))
        if state_pairs:
            src, dst = zip(*state_pairs)
            self.states.copy(list(src), list(dst))

    def offload(self, block_ids: np.ndarray, state_slots: list[int]) -> OffloadedCaches:
        """Host copies of the given blocks and state slots (suspend OFFLOAD), taken before release."""
        kv = self.kv.offload(block_ids.tolist()) if block_ids.size else None
        states = self.states.offload(state_slots) if state_slots and self.states is not None else None
        return OffloadedCaches(block_ids, kv, list(state_slots), states)

    def restore(self, saved: OffloadedCaches, fresh_blocks: np.ndarray, rows: np.ndarray) -> None:
        """Write saved contents back after `reacquire`: block `saved.block_ids[rows[i]]` now lives at
        `fresh_blocks[i]`; state slots keep their ids (the pool's bookkeeping survives suspend)."""
        if saved.kv is not None and fresh_blocks.size:
            self.kv.restore(fresh_blocks.tolist(), saved.kv[:, :, torch.from_numpy(rows)])
        if saved.states is not None:
            self.states.restore(saved.state_slots, saved.states)

    def stats(self) -> dict:
        out = {"kv_cache_bytes": self.kv.nbytes, "prefix_caching": self.allocator.enable_prefix_caching}
        if self.states is not None:
            out.update(state_pool_bytes=self.states.nbytes, state_slots_held=self.states.held)
        if self.snapshots is not None:
            out.update(self.snapshots.stats())
        if self.prefix_caching_disabled_reason:
            out["prefix_caching_off_because"] = self.prefix_caching_disabled_reason
        return out
