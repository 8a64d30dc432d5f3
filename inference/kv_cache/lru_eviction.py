"""LRU eviction of cached prefix blocks: the count of what could be evicted, and the victims, least
recently used leaf first, peeled from the cached forest inwards (a mixin of `PrefixCacheBlockState`,
over its per-block arrays and heap)."""

from __future__ import annotations

import heapq
from typing import Any, Optional

import torch

from inference.kv_cache.hashing import UNSET_HASH


def _as_tensor(block_ids: list[int]) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.int64)


class LRUEviction:
    """`PrefixCacheBlockState`'s eviction (module docstring); the state it reads and writes is the block
    state's (its class invariant holds across both files)."""

    _num_cached: int
    _lru_heap: list
    _refs: Any
    _hashes: Any
    _queued: Any
    _timestamps: Any
    _parents: Any
    _child_counts: Any
    block_ref_counts: Any
    block_hashes: Any

    def get_evictable_block_count(self) -> torch.Tensor:
        """Blocks the public tensors show as cached: zero references and a hash (any policy).

        Scans the pool, so it also counts state a caller wrote into `block_ref_counts` or
        `block_hashes` directly. The eviction path keeps its own count: `num_cached`.
        """
        return torch.count_nonzero((self.block_ref_counts == 0) & (self.block_hashes != UNSET_HASH))

    @property
    def num_cached(self) -> int:
        """Registered zero-ref blocks as this class's own bookkeeping counts them (LRU only), O(1)."""
        return self._num_cached

    def extra_blocks_available(self) -> int:
        """Blocks that eviction could hand to the free pool (always 0 under REF_ZERO)."""
        return self._num_cached if self.is_lru else 0

    def try_lru_evict_for_pool(self, num_blocks_needed: int) -> Optional[tuple[torch.Tensor, list[int]]]:
        """Pick and deregister `num_blocks_needed` LRU victims: (victims, hashes to drop), or None.

        None under REF_ZERO, or when fewer blocks can be evicted; then nothing changed.
        The caller pushes the victims onto the free pool.
        """
        evicted = self.evict_lru_leaves(num_blocks_needed)
        if evicted is None:
            return None
        return _as_tensor(evicted[0]), evicted[1]

    def evict_lru_leaves(self, num_blocks_needed: int) -> Optional[tuple[list[int], list[int]]]:
        """`try_lru_evict_for_pool` with a list of victims (the allocator's form)."""
        if not self.is_lru:
            return None
        victims = self._peel_lru_leaves(num_blocks_needed, commit=True)
        if victims is None:
            return None
        # NOTE: the peel already queued the parents it turned into leaves
        return victims, self.deregister_blocks(victims, requeue_parents=False)

    def find_lru_evictable(self, num_blocks_needed: int) -> Optional[torch.Tensor]:
        """Exactly `num_blocks_needed` evictable blocks, least recently used leaf first, or None.

        A query: it changes no state, so asking twice names the same blocks, and they are the
        ones `try_lru_evict_for_pool` would evict next. To evict them yourself, call
        `deregister_blocks` on them and push them onto the free pool. Calling it under REF_ZERO,
        which has no cached reservoir, is a caller bug: AssertionError.
        """
        if not self.is_lru:
            raise AssertionError("find_lru_evictable needs the LRU eviction policy")
        victims = self._peel_lru_leaves(num_blocks_needed, commit=False)
        return None if victims is None else _as_tensor(victims)

    def _peel_lru_leaves(self, num_blocks_needed: int, commit: bool) -> Optional[list[int]]:
        """The next `num_blocks_needed` LRU victims, or None; with `commit`, take them off the heap.

        Peels the cached forest from its leaves inwards: the heap yields leaves by their own
        timestamp, and a parent whose children were all picked becomes a leaf, queued in a
        pass-local heap merged with the main one. O(k log n) for k victims. Without `commit`
        (or on None) the popped entries go back, so the heap is as before; with it, entries
        popped stay dropped (see the class invariant) and the pass-local leaves join the heap.
        """
        if num_blocks_needed > self._num_cached:
            return None
        if num_blocks_needed <= 0:
            return []
        heap, refs, hashes, queued = self._lru_heap, self._refs, self._hashes, self._queued
        timestamps, parents, children = self._timestamps, self._parents, self._child_counts
        found: list[tuple[int, int]] = []  # leaves that were not queued when this pass began
        in_found: set[int] = set()
        popped: list[tuple[int, int]] = []
        victims: list[int] = []
        children_gone: dict[int, int] = {}  # parent -> its children picked in this pass
        while len(victims) < num_blocks_needed:
            if found and (not heap or found[0] < heap[0]):
                key, block_id = heapq.heappop(found)
                in_found.discard(block_id)
            elif heap:
                entry = heapq.heappop(heap)
                popped.append(entry)
                key, block_id = entry
                queued[block_id] = False
            else:
                break
            if refs[block_id] != 0 or hashes[block_id] == UNSET_HASH:
                continue  # in use or gone: queued again when it is released again
            if children[block_id] != children_gone.get(block_id, 0):
                continue  # not a leaf: queued again when its last child goes
            stamp = int(timestamps[block_id])
            if key != stamp:  # used since it was queued: re-key, keep the order exact
                if block_id not in in_found:
                    heapq.heappush(found, (stamp, block_id))
                    in_found.add(block_id)
                continue
            victims.append(block_id)
            parent = int(parents[block_id])
            if parent >= 0:
                gone = children_gone.get(parent, 0) + 1
                children_gone[parent] = gone
                if (children[parent] == gone and refs[parent] == 0 and hashes[parent] != UNSET_HASH
                        and not queued[parent] and parent not in in_found):
                    heapq.heappush(found, (int(timestamps[parent]), parent))
                    in_found.add(parent)
        if commit and len(victims) == num_blocks_needed:
            for entry in found:
                queued[entry[1]] = True
                heapq.heappush(heap, entry)
            return victims
        for entry in popped:
            queued[entry[1]] = True
            heapq.heappush(heap, entry)
        # NOTE: short only if a cached block sits above a child still in use; nothing changed.
        return victims if len(victims) == num_blocks_needed else None

    def _enqueue(self, block_id: int) -> None:
        if not self._queued[block_id]:
            self._queued[block_id] = True
            heapq.heappush(self._lru_heap, (int(self._timestamps[block_id]), block_id))
