"""Per-block shadow state for prefix caching: hashes, ref counts, LRU clock and parent chain.

Registry-free: every mutation that deregisters blocks returns the hashes the caller must drop
from the `PrefixCacheRegistry`, so the registry stays the only seam to a remote cache.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from typing import Optional, Union

import numpy as np
import torch

from inference.kv_cache.hashing import UNSET_HASH
from inference.kv_cache.policy import EvictionPolicy

MAX_CACHED_PROMPT_TOP_N_LOGPROBS = 100

BlockIds = Union[torch.Tensor, np.ndarray, Iterable[int]]


def _as_list(block_ids: BlockIds) -> list[int]:
    if isinstance(block_ids, (torch.Tensor, np.ndarray)):
        return block_ids.tolist()
    return list(block_ids)


class PromptLogprobsBlock:
    """Prompt log-probs cached on one KV block, slot i scoring the token after the block's token i.

    The last slot scores the first token of the next block, which this block's hash does not
    cover; that token is kept in `next_token_id` so a reader can tell whether the slot applies.
    """

    __slots__ = ("top_n", "log_probs", "top_n_log_probs", "top_n_token_ids", "valid", "next_token_id")

    def __init__(self, block_size: int, top_n: int) -> None:
        if not 0 <= top_n <= MAX_CACHED_PROMPT_TOP_N_LOGPROBS:
            raise ValueError(f"top_n must be in [0, {MAX_CACHED_PROMPT_TOP_N_LOGPROBS}], got {top_n}")
        self.top_n = top_n
        self.log_probs = torch.zeros(block_size, dtype=torch.float32)
        self.top_n_log_probs = torch.zeros(block_size, top_n, dtype=torch.float32)
        self.top_n_token_ids = torch.zeros(block_size, top_n, dtype=torch.int64)
        self.valid = torch.zeros(block_size, dtype=torch.bool)
        self.next_token_id = -1


class PrefixCacheBlockState:
    """Shadow state of every block of a pool of `pool_size` blocks.

    Invariants:
    * `block_ref_counts >= 0`; a block with a hash (!= -1) is registered in the registry.
    * Under REF_ZERO, a registered block always has ref count > 0 (cached reservoir is empty).
    * Under LRU, `_child_counts[b]` is the number of registered blocks whose parent is b, and
      only a zero-ref registered block with no registered child (a leaf) may be evicted, so a
      cached child always has its whole ancestor chain cached.
    * `_lru_heap` holds at most one entry per block (`_queued` marks which). Every evictable
      leaf is queued under a key <= its timestamp: a block used again keeps its old entry, which
      is re-keyed when popped, so the minimum popped with a current key is the true LRU leaf.
      Entries of blocks that stopped being evictable leaves are dropped when popped.

    The public tensors share memory with numpy arrays used for fast scalar updates.
    """

    def __init__(self, pool_size: int, eviction_policy: EvictionPolicy) -> None:
        if pool_size < 1:
            raise ValueError(f"pool_size must be >= 1, got {pool_size}")
        self.pool_size = pool_size
        self.eviction_policy = EvictionPolicy(eviction_policy)
        self._hashes = np.full(pool_size, UNSET_HASH, dtype=np.int64)
        self._refs = np.zeros(pool_size, dtype=np.int32)
        self.block_hashes = torch.from_numpy(self._hashes)
        self.block_ref_counts = torch.from_numpy(self._refs)
        self.prompt_logprobs: dict[int, PromptLogprobsBlock] = {}
        if self.is_lru:
            self._timestamps = np.zeros(pool_size, dtype=np.int64)
            self._parents = np.full(pool_size, -1, dtype=np.int64)
            self._child_counts = np.zeros(pool_size, dtype=np.int32)
            self.block_timestamps: Optional[torch.Tensor] = torch.from_numpy(self._timestamps)
        else:
            self.block_timestamps = None
        self._lru_heap: list[tuple[int, int]] = []
        self._queued = np.zeros(pool_size, dtype=bool)
        self._num_cached = 0  # registered blocks with ref count 0 (LRU only)

    def hash_of(self, block_id: int) -> int:
        return int(self._hashes[block_id])

    def ref_count(self, block_id: int) -> int:
        return int(self._refs[block_id])

    @property
    def is_lru(self) -> bool:
        return self.eviction_policy is EvictionPolicy.LRU

    def reset(self) -> None:
        """Forget every block's state. The caller clears the registry and refills the free pool."""
        self._hashes.fill(UNSET_HASH)
        self._refs.fill(0)
        self.prompt_logprobs.clear()
        if self.is_lru:
            self._timestamps.fill(0)
            self._parents.fill(-1)
            self._child_counts.fill(0)
        self._lru_heap.clear()
        self._queued.fill(False)
        self._num_cached = 0

    # ---- registration ------------------------------------------------------------------------

    def stamp_block_hashes(self, block_ids: BlockIds, block_hashes: list[int]) -> list[int]:
        """Write hashes for blocks that have none yet; return the positions newly stamped."""
        ids = _as_list(block_ids)
        if len(ids) != len(block_hashes):
            raise ValueError(f"{len(ids)} block ids but {len(block_hashes)} hashes")
        stamped = []
        hashes = self._hashes
        for pos, (block_id, h) in enumerate(zip(ids, block_hashes)):
            if hashes[block_id] == UNSET_HASH and h > 0:
                hashes[block_id] = h
                stamped.append(pos)
        return stamped

    def record_parent_chain(self, block_ids: BlockIds, parent_ids: BlockIds) -> None:
        """Remember each new block's parent (-1 for a root) so eviction peels leaves first."""
        if not self.is_lru:
            return
        for block_id, parent in zip(_as_list(block_ids), _as_list(parent_ids)):
            self._parents[block_id] = parent
            if parent >= 0:
                self._child_counts[parent] += 1

    # ---- references --------------------------------------------------------------------------

    def update_timestamps(self, block_ids: BlockIds, lru_clock: int) -> None:
        if self.is_lru:
            self._timestamps[_as_list(block_ids)] = lru_clock

    def on_allocate(self, block_ids: BlockIds, lru_clock: int) -> None:
        """Blocks just popped from the free pool: one reference each, stamped now."""
        ids = _as_list(block_ids)
        self._refs[ids] = 1
        if self.is_lru:
            self._timestamps[ids] = lru_clock

    def retain(self, block_ids: BlockIds, lru_clock: int) -> None:
        """One more reference per occurrence (a matched prefix, a forked group)."""
        refs, hashes = self._refs, self._hashes
        lru = self.is_lru
        for block_id in _as_list(block_ids):
            if lru and refs[block_id] == 0 and hashes[block_id] != UNSET_HASH:
                self._num_cached -= 1  # leaves the cached reservoir; its heap entry goes stale
            refs[block_id] += 1
            if lru:
                self._timestamps[block_id] = lru_clock

    def check_releasable(self, block_ids: list[int]) -> None:
        """Raise ValueError, changing nothing, if a release would drive a ref count below zero."""
        refs = self._refs
        if len(set(block_ids)) == len(block_ids):
            bad = [b for b in block_ids if refs[b] <= 0]
        else:
            bad = [b for b, n in Counter(block_ids).items() if refs[b] < n]
        if bad:
            raise ValueError(f"release of blocks {bad[:8]} exceeds the references held on them")

    def on_release_compute_pool_returns(self, blocks: BlockIds) -> tuple[list[int], list[int]]:
        """Drop one reference per occurrence; return (blocks for the free pool, hashes to drop).

        A block listed twice loses two references but is returned at most once. REF_ZERO frees
        and deregisters every block reaching zero. LRU returns only unregistered zero-ref blocks;
        registered ones stay cached and become eviction candidates.
        """
        ids = _as_list(blocks)
        refs = self._refs
        self.check_releasable(ids)
        for_pool: list[int] = []
        hashes_to_drop: list[int] = []
        for block_id in ids:
            refs[block_id] -= 1
            if refs[block_id] == 0:
                for_pool.append(block_id)
        if not self.is_lru:
            hashes_to_drop = self.deregister_blocks(for_pool)
            return for_pool, [h for h in hashes_to_drop if h != UNSET_HASH]
        to_pool = []
        for block_id in for_pool:
            if self._hashes[block_id] == UNSET_HASH:
                to_pool.append(block_id)
            else:
                self._num_cached += 1
                if self._child_counts[block_id] == 0:
                    self._enqueue(block_id)
        return to_pool, hashes_to_drop

    # ---- eviction ----------------------------------------------------------------------------

    def get_evictable_block_count(self) -> int:
        """Registered blocks with zero references (always 0 under REF_ZERO)."""
        return self._num_cached

    def extra_blocks_available(self) -> int:
        """Blocks that eviction could hand to the free pool."""
        return self._num_cached if self.is_lru else 0

    def try_lru_evict_for_pool(self, num_blocks_needed: int) -> Optional[tuple[list[int], list[int]]]:
        """Pick and deregister `num_blocks_needed` LRU victims: (victims, hashes to drop), or None.

        None under REF_ZERO, or when fewer blocks can be evicted; then nothing changed.
        The caller pushes the victims onto the free pool.
        """
        victims = self.find_lru_evictable(num_blocks_needed)
        if victims is None:
            return None
        # NOTE: the peel above already queued the parents it turned into leaves
        return victims, self.deregister_blocks(victims, requeue_parents=False)

    def find_lru_evictable(self, num_blocks_needed: int) -> Optional[list[int]]:
        """Exactly `num_blocks_needed` evictable blocks, least recently used leaf first, or None.

        Peels the cached forest from its leaves inwards with a min-heap keyed by each block's
        own timestamp: evicting a leaf may make its parent a leaf, which then joins the heap.
        Costs O(k log n) for k victims. Changes no block state, but the victims leave the heap:
        the caller must deregister them (`try_lru_evict_for_pool` does both). On None, the heap
        holds every evictable leaf as before.
        """
        if not self.is_lru or num_blocks_needed > self._num_cached:
            return None
        if num_blocks_needed <= 0:
            return []
        heap, refs, hashes, queued = self._lru_heap, self._refs, self._hashes, self._queued
        timestamps, parents, children = self._timestamps, self._parents, self._child_counts
        victims: list[int] = []
        children_gone: dict[int, int] = {}  # parent -> its children chosen in this call
        while len(victims) < num_blocks_needed and heap:
            key, block_id = heapq.heappop(heap)
            queued[block_id] = False
            if refs[block_id] != 0 or hashes[block_id] == UNSET_HASH:
                continue  # in use or gone: re-queued when it is released again
            if children[block_id] != children_gone.get(block_id, 0):
                continue  # not a leaf: queued again when its last child goes
            if key != timestamps[block_id]:  # used since it was queued: re-key, keep order exact
                self._enqueue(block_id)
                continue
            victims.append(block_id)
            parent = int(parents[block_id])
            if parent >= 0:
                gone = children_gone.get(parent, 0) + 1
                children_gone[parent] = gone
                if children[parent] == gone and refs[parent] == 0 and hashes[parent] != UNSET_HASH:
                    self._enqueue(parent)
        if len(victims) < num_blocks_needed:
            # NOTE: possible only if a cached block sits above a child still in use; keep state.
            for block_id in victims:
                self._enqueue(block_id)
            return None
        return victims

    def _enqueue(self, block_id: int) -> None:
        if not self._queued[block_id]:
            self._queued[block_id] = True
            heapq.heappush(self._lru_heap, (int(self._timestamps[block_id]), block_id))

    def deregister_blocks(self, block_ids: BlockIds, requeue_parents: bool = True) -> list[int]:
        """Reset the state of `block_ids` and return their hashes (-1 for unregistered ones).

        Touches neither the registry nor the free pool: both are the caller's job. Parents
        left without registered children become eviction candidates (`requeue_parents=False`
        when the caller's eviction pass has queued them already).
        """
        ids = _as_list(block_ids)
        hashes = self._hashes
        dropped = [int(hashes[b]) for b in ids]
        lru = self.is_lru
        for block_id, h in zip(ids, dropped):
            if h == UNSET_HASH:
                continue
            hashes[block_id] = UNSET_HASH
            self.prompt_logprobs.pop(block_id, None)
            if not lru:
                continue
            if self._refs[block_id] == 0:
                self._num_cached -= 1
            parent = int(self._parents[block_id])
            if parent >= 0:
                self._parents[block_id] = -1
                self._child_counts[parent] -= 1
                if (requeue_parents and self._child_counts[parent] == 0 and self._refs[parent] == 0
                        and hashes[parent] != UNSET_HASH):
                    self._enqueue(parent)
        return dropped

    def detach_all(self) -> list[int]:
        """Deregister every block at once (prefix-cache reset); return the zero-ref cached ones.

        Blocks in use keep their references and owners but lose their hashes, so nothing
        computed before the reset can be matched again.
        """
        cached = np.flatnonzero((self._hashes != UNSET_HASH) & (self._refs == 0)).tolist()
        self._hashes.fill(UNSET_HASH)
        self.prompt_logprobs.clear()
        if self.is_lru:
            self._parents.fill(-1)
            self._child_counts.fill(0)
        self._lru_heap.clear()
        self._queued.fill(False)
        self._num_cached = 0
        return cached
