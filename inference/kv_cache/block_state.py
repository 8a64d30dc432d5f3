"""Per-block shadow state for prefix caching: hashes, ref counts, LRU clock and parent chain.

Registry-free: every mutation that deregisters blocks returns the hashes the caller must drop
from the `PrefixCacheRegistry`, so the registry stays the only seam to a remote cache.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Optional, Union

import numpy as np
import torch

from inference.kv_cache.block_key import BlockKey
from inference.kv_cache.hashing import UNSET_HASH
from inference.kv_cache.lru_eviction import LRUEviction, _as_tensor
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

    __slots__ = ("top_n", "log_probs", "top_n_log_probs", "top_n_token_ids", "ranks", "valid", "next_token_id")

    def __init__(self, block_size: int, top_n: int) -> None:
        if not 0 <= top_n <= MAX_CACHED_PROMPT_TOP_N_LOGPROBS:
            raise ValueError(f"top_n must be in [0, {MAX_CACHED_PROMPT_TOP_N_LOGPROBS}], got {top_n}")
        self.top_n = top_n
        self.log_probs = torch.zeros(block_size, dtype=torch.float32)
        self.top_n_log_probs = torch.zeros(block_size, top_n, dtype=torch.float32)
        self.top_n_token_ids = torch.zeros(block_size, top_n, dtype=torch.int64)
        self.ranks = torch.zeros(block_size, dtype=torch.int64)  # each scored token's vocabulary rank (vLLM's)
        self.valid = torch.zeros(block_size, dtype=torch.bool)
        self.next_token_id = -1


class PrefixCacheBlockState(LRUEviction):
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
    * `_num_cached` counts the registered zero-ref blocks through this class's own mutations;
      `get_evictable_block_count()` recounts them from the public tensors instead.
    * A registered block records the key it was registered under (`key_of`) and the policy
      version whose weights computed it (`computed_by`); an unregistered one records neither.
      All blocks of one hash chain share its key (the key is mixed into every hash of it).

    The public tensors share memory with numpy arrays used for fast scalar updates. The seed's
    tensor-returning methods have list-returning twins (`release_references`,
    `evict_lru_leaves`) that the allocator uses on its hot path.
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
        self._keys: list[Optional[BlockKey]] = [None] * pool_size
        self._key_versions = np.full(pool_size, -1, dtype=np.int64)  # the key's version, for counts
        self._computed_by = np.full(pool_size, -1, dtype=np.int64)
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

    def key_of(self, block_id: int) -> Optional[BlockKey]:
        """The key a registered block was registered under (None: not registered)."""
        return self._keys[block_id]

    def computed_by(self, block_id: int) -> int:
        """The policy version whose weights computed a registered block's K/V (-1: not registered)."""
        return int(self._computed_by[block_id])

    def record_keys(self, block_ids: list[int], keys: list[BlockKey], computed_by: int) -> None:
        """Freshly registered blocks: each one's chain key and the version that computed them."""
        for block_id, key in zip(block_ids, keys):
            self._keys[block_id] = key
        self._key_versions[block_ids] = [key.version for key in keys]
        self._computed_by[block_ids] = computed_by

    def registered_ids(self, key_versions: Optional[Iterable[int]] = None) -> list[int]:
        """Registered blocks (optionally only those whose key has one of `key_versions`)."""
        mask = self._hashes != UNSET_HASH
        if key_versions is not None:
            mask &= np.isin(self._key_versions, list(key_versions))
        return np.flatnonzero(mask).tolist()

    def keyed_by(self, block_ids: list[int], key_versions: set[int]) -> list[int]:
        """The registered ones of `block_ids` whose key has one of `key_versions`."""
        ids = np.asarray(block_ids, dtype=np.int64)
        mask = (self._hashes[ids] != UNSET_HASH) & np.isin(self._key_versions[ids], list(key_versions))
        return ids[mask].tolist()

    def blocks_by_key_version(self) -> dict[int, int]:
        """Registered blocks per key version (the version their chain is keyed by)."""
        versions = self._key_versions[self._hashes != UNSET_HASH]
        found, counts = np.unique(versions, return_counts=True)
        return dict(zip(found.tolist(), counts.tolist()))

    def _forget_keys(self, block_ids) -> None:
        for block_id in block_ids:
            self._keys[block_id] = None
        self._key_versions[block_ids] = -1
        self._computed_by[block_ids] = -1

    @property
    def is_lru(self) -> bool:
        return self.eviction_policy is EvictionPolicy.LRU

    def reset(self) -> None:
        """Forget every block's state. The caller clears the registry and refills the free pool."""
        self._hashes.fill(UNSET_HASH)
        self._refs.fill(0)
        self.prompt_logprobs.clear()
        self._forget_keys(range(self.pool_size))
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
        ids = np.asarray(_as_list(block_ids), dtype=np.int64)
        parents = np.asarray(_as_list(parent_ids), dtype=np.int64)
        self._parents[ids] = parents
        np.add.at(self._child_counts, parents[parents >= 0], 1)  # NOTE: a parent may be listed twice

    def all_registrable(self, block_ids: list[int], block_hashes: list[int], run_parents: list[int],
                        taken: Mapping[int, int]) -> bool:
        """Whether the blocks of several runs (`run_parents[i]`: the block before run i, -1: none)
        may all join the cache, checked at once: distinct blocks, held and unhashed, under distinct
        hashes none of which is `taken`, each run after a hashed, held parent outside the runs.
        False leaves the caller to check run by run."""
        if len(set(block_hashes)) != len(block_hashes) or not taken.keys().isdisjoint(block_hashes):
            return False
        if len(set(block_ids)) != len(block_ids):
            return False
        ids = np.asarray(block_ids, dtype=np.int64)
        if (self._hashes[ids] != UNSET_HASH).any() or (self._refs[ids] <= 0).any():
            return False
        parents = np.asarray(run_parents, dtype=np.int64)
        parents = parents[parents >= 0]
        return not ((self._hashes[parents] == UNSET_HASH).any() or (self._refs[parents] <= 0).any())

    def stamp_all(self, block_ids: list[int], block_hashes: list[int]) -> None:
        """Write the hashes of blocks `all_registrable` accepted."""
        self._hashes[block_ids] = block_hashes

    def stamp_registrable(self, block_ids: list[int], block_hashes: list[int], parent_block_id: int,
                          taken: Mapping[int, int]) -> int:
        """Stamp the leading blocks of a run that may join the cache; return how many.

        None may if the run's parent (-1: none) has no hash or no reference; the run stops at a
        block already hashed or unheld, or whose hash is `taken` (served by another block).
        """
        stored, refs = self._hashes, self._refs
        if parent_block_id >= 0 and (stored[parent_block_id] == UNSET_HASH or refs[parent_block_id] <= 0):
            return 0
        count = 0
        for block_id, h in zip(block_ids, block_hashes):
            if h in taken or stored[block_id] != UNSET_HASH or refs[block_id] <= 0:
                break
            stored[block_id] = h
            count += 1
        return count

    def attach_prompt_logprobs(self, block_ids: list[int],
                               blocks: Optional[list[Optional[PromptLogprobsBlock]]]) -> None:
        """Cache prompt log-probs on freshly registered blocks (None: the block carries none).

        A block's entry lives exactly as long as its hash: deregistering, a prefix-cache reset
        and `reset` drop it, so no score outlives the weights that computed it.
        """
        if blocks is None:
            if self.prompt_logprobs:  # NOTE: defensive; entries already go with their hashes
                for block_id in block_ids:
                    self.prompt_logprobs.pop(block_id, None)
            return
        for block_id, block in zip(block_ids, blocks):
            if block is None:
                self.prompt_logprobs.pop(block_id, None)
            else:
                self.prompt_logprobs[block_id] = block

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

    def on_release_compute_pool_returns(self, blocks: BlockIds) -> tuple[torch.Tensor, list[int]]:
        """Drop one reference per occurrence; return (blocks for the free pool, hashes to drop).

        A block listed twice loses two references but is returned at most once. REF_ZERO frees
        and deregisters every block reaching zero and returns each one's hash, -1 for a block
        that never had one. LRU returns only unregistered zero-ref blocks and no hashes;
        registered ones stay cached and become eviction candidates.
        """
        for_pool, hashes_to_drop = self.release_references(_as_list(blocks))
        return _as_tensor(for_pool), hashes_to_drop

    def release_references(self, block_ids: list[int]) -> tuple[list[int], list[int]]:
        """`on_release_compute_pool_returns` with a list of free-pool blocks (the allocator's form)."""
        refs = self._refs
        self.check_releasable(block_ids)
        reached_zero: list[int] = []
        for block_id in block_ids:
            refs[block_id] -= 1
            if refs[block_id] == 0:
                reached_zero.append(block_id)
        if not self.is_lru:
            return reached_zero, self.deregister_blocks(reached_zero)
        to_pool = []
        for block_id in reached_zero:
            if self._hashes[block_id] == UNSET_HASH:
                to_pool.append(block_id)
            else:
                self._num_cached += 1
                if self._child_counts[block_id] == 0:
                    self._enqueue(block_id)
        return to_pool, []

    # ---- deregistration ----------------------------------------------------------------------

    def deregister_blocks(self, block_ids: BlockIds, requeue_parents: bool = True) -> list[int]:
        """Reset the state of `block_ids` (hash, ref count, timestamp); return their old hashes.

        An unregistered block yields -1. Touches neither the registry nor the free pool: both
        are the caller's job. Parents left without registered children become eviction
        candidates (`requeue_parents=False` when the caller's eviction pass queued them already).
        """
        ids = _as_list(block_ids)
        hashes, refs, lru = self._hashes, self._refs, self.is_lru
        dropped: list[int] = []
        for block_id in ids:
            h = int(hashes[block_id])  # NOTE: read per block, so a repeated id yields -1 the 2nd time
            dropped.append(h)
            self.prompt_logprobs.pop(block_id, None)
            if lru:
                self._timestamps[block_id] = 0
                if h != UNSET_HASH:
                    self._unlink(block_id, requeue_parents)
            hashes[block_id] = UNSET_HASH
            refs[block_id] = 0
        self._forget_keys(ids)
        return dropped

    def _unlink(self, block_id: int, requeue_parents: bool) -> None:
        """Take a registered block out of the LRU bookkeeping, before its state is reset."""
        if self._refs[block_id] == 0:
            self._num_cached -= 1
        parent = int(self._parents[block_id])
        if parent < 0:
            return
        self._parents[block_id] = -1
        self._child_counts[parent] -= 1
        if (requeue_parents and self._child_counts[parent] == 0 and self._refs[parent] == 0
                and self._hashes[parent] != UNSET_HASH):
            self._enqueue(parent)

    def detach_all(self) -> list[int]:
        """Deregister every block at once (prefix-cache reset); return the zero-ref cached ones.

        Blocks in use keep their references and owners but lose their hashes, so nothing
        computed before the reset can be matched again.
        """
        cached = np.flatnonzero((self._hashes != UNSET_HASH) & (self._refs == 0)).tolist()
        self._hashes.fill(UNSET_HASH)
        self.prompt_logprobs.clear()
        self._forget_keys(range(self.pool_size))
        if self.is_lru:
            self._parents.fill(-1)
            self._child_counts.fill(0)
        self._lru_heap.clear()
        self._queued.fill(False)
        self._num_cached = 0
        return cached

    def detach_blocks(self, block_ids: list[int]) -> tuple[list[int], list[int]]:
        """Deregister `block_ids` (whole chains: with each block, every registered descendant of it
        is listed too), held or not: (zero-ref ones, for the free pool; their old hashes).

        Held blocks keep their references and owners, unregistered, and go to the free pool on
        release, as after `detach_all`.
        """
        ids = [b for b in block_ids if self._hashes[b] != UNSET_HASH]
        if not ids:
            return [], []
        dropped = self._hashes[ids].tolist()
        if self.is_lru:
            for block_id in ids:
                self._unlink(block_id, requeue_parents=True)
            self._child_counts[ids] = 0
            self._timestamps[[b for b in ids if self._refs[b] == 0]] = 0
        free = [b for b in ids if self._refs[b] == 0]
        self._hashes[ids] = UNSET_HASH
        for block_id in ids:
            self.prompt_logprobs.pop(block_id, None)
        self._forget_keys(ids)
        return free, dropped

    def demote(self, block_ids: list[int]) -> None:
        """Make these cached blocks the next LRU victims (their users are gone): their recency goes to 0."""
        if not self.is_lru or not block_ids:
            return
        ids = set(block_ids)
        self._timestamps[list(ids)] = 0
        # NOTE: one heap entry per block: rebuild it rather than push second entries (rare: per update)
        heap = [(key, b) for key, b in self._lru_heap if b not in ids]
        for block_id in ids:
            self._queued[block_id] = False
            if self._refs[block_id] == 0 and self._hashes[block_id] != UNSET_HASH and self._child_counts[block_id] == 0:
                heap.append((0, block_id))
                self._queued[block_id] = True
        heapq.heapify(heap)
        self._lru_heap = heap
