"""The KV block allocator: a free pool of fixed-size blocks with a prefix cache on top.

`allocate` hands out blocks (evicting cached LRU leaves when the free pool runs short),
`match_prefix` shares blocks whose content is already computed, `register` makes freshly
computed full blocks matchable, `release` drops references, and `reset_prefix_cache` makes
every cached hash unmatchable at once, even while requests still hold blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from inference.errors import BlockOverflowError
from inference.kv_cache.block_key import BlockKey
from inference.kv_cache.block_state import BlockIds, PrefixCacheBlockState, PromptLogprobsBlock, _as_list
from inference.kv_cache.events import BlockStored, KVEventHub
from inference.kv_cache.hashing import NO_PARENT, UNSET_HASH
from inference.kv_cache.policy import EvictionPolicy
from inference.kv_cache.registry import PrefixCacheRegistry

logger = logging.getLogger(__name__)

UNSALTED_V0 = BlockKey(0)  # the key of callers that never update weights nor salt (tests, a frozen engine)


@dataclass(frozen=True, slots=True)
class KVPoolStats:
    """A snapshot of the pool: total == free + active + cached."""

    total: int
    free: int
    active: int
    cached: int
    hit_blocks: int
    miss_blocks: int

    @property
    def hit_rate(self) -> float:
        looked_up = self.hit_blocks + self.miss_blocks
        return self.hit_blocks / looked_up if looked_up else 0.0


@dataclass(slots=True)
class BlockRun:
    """One request's freshly computed consecutive full blocks, to register: `block_ids[i]` under
    `hashes[i]` (each block the parent of the next), `parent_block_id` the block before the run (-1
    at a sequence's start), `key` the chain's key, `prompt_logprobs[i]` (if given) cached with
    block i."""

    block_ids: list[int]
    hashes: list[int]
    parent_block_id: int = -1
    key: BlockKey = UNSALTED_V0
    prompt_logprobs: Sequence[PromptLogprobsBlock | None] | None = None


class KVBlockAllocator:
    """Owns the free pool, the per-block state and the prefix-cache registry of one KV buffer.

    Every block is in exactly one place: the free pool (no hash, no references), active
    (ref count > 0, registered or not) or cached (LRU only: registered, no references).
    Owners hold prefix-closed chains: a request that holds a registered block also holds that
    block's registered ancestors, which `register` enforces by refusing to chain a block to a
    parent the caller does not hold.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        eviction_policy: EvictionPolicy = EvictionPolicy.REF_ZERO,
        enable_prefix_caching: bool = True,
        events: KVEventHub | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.eviction_policy = EvictionPolicy(eviction_policy)
        self.enable_prefix_caching = enable_prefix_caching
        self.registry = PrefixCacheRegistry()
        self.state = PrefixCacheBlockState(num_blocks, self.eviction_policy)
        self.events = events if events is not None else KVEventHub()
        # NOTE: a stack popped from the end, filled so that a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.lru_clock = 0
        self._demoted: set[int] = set()  # key versions without a live user: their blocks go first
        self.hit_blocks = 0
        self.miss_blocks = 0

    # ---- counts ------------------------------------------------------------------------------

    @property
    def total(self) -> int:
        return self.num_blocks

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def cached(self) -> int:
        return self.state.num_cached

    @property
    def active(self) -> int:
        return self.num_blocks - len(self._free) - self.cached

    @property
    def available(self) -> int:
        """Blocks `allocate` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + self.state.extra_blocks_available()

    def stats(self) -> KVPoolStats:
        return KVPoolStats(self.total, self.free, self.active, self.cached, self.hit_blocks, self.miss_blocks)

    def free_block_ids(self) -> list[int]:
        return list(self._free)

    # ---- allocation --------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` fresh blocks, one reference each; evicts LRU leaves if the pool is short.

        Raises `BlockOverflowError` (transient) and changes nothing when even eviction cannot
        provide them.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks == 0:
            return []
        shortfall = num_blocks - len(self._free)
        if shortfall > 0:
            evicted = self.state.evict_lru_leaves(shortfall)
            if evicted is None:
                raise BlockOverflowError(
                    None,
                    f"need {num_blocks} KV blocks, {len(self._free)} free and "
                    f"{self.state.extra_blocks_available()} evictable of {self.num_blocks}",
                    is_transient=num_blocks <= self.num_blocks,
                )
            victims, hashes = evicted
            self._drop_from_registry(hashes)
            self._free.extend(victims)
        self.lru_clock += 1
        block_ids = self._free[-num_blocks:]
        del self._free[-num_blocks:]
        block_ids.reverse()
        self.state.on_allocate(block_ids, self.lru_clock)
        return block_ids

    def release(self, block_ids: BlockIds) -> None:
        """Drop one reference per listed block; blocks nobody holds go free or stay cached."""
        ids = _as_list(block_ids)
        if not ids:
            return
        self.state.check_releasable(ids)
        self.lru_clock += 1
        # NOTE: stamp first, so a released block's recency is its last use, not its allocation.
        self.state.update_timestamps(ids, self.lru_clock)
        if self._demoted:  # NOTE: a block of a version nobody may match again stays first to go
            self.state.update_timestamps(self.state.keyed_by(ids, self._demoted), 0)
        for_pool, hashes = self.state.release_references(ids)
        self._drop_from_registry(hashes)
        self._free.extend(for_pool)

    def retain(self, block_ids: BlockIds) -> None:
        """One more reference per listed block (e.g. samples of a group sharing their prompt)."""
        ids = _as_list(block_ids)
        for block_id in ids:
            if self.state.ref_count(block_id) <= 0:
                raise ValueError(f"cannot retain block {block_id}: it is not allocated")
        self.lru_clock += 1
        self.state.retain(ids, self.lru_clock)

    # ---- prefix cache ------------------------------------------------------------------------

    def match_prefix(self, hashes: list[int], looked_up: int | None = None, *, key: BlockKey | None = None,
                     current_version: int | None = None) -> list[int]:
        """Blocks of the longest cached prefix of `hashes`, each retained for the caller.

        `looked_up` (default `len(hashes)`) is how many blocks the caller wanted, for the hit
        rate: a caller that cut `hashes` short (a cached block lacking what it needs) counts the
        blocks it left out as misses. With `key`, the match rule holds on each block's records,
        not only on its hash (see `matchable`).
        """
        if not self.enable_prefix_caching:
            return []
        looked_up = len(hashes) if looked_up is None else looked_up
        block_ids = self.registry.match_kv_prefix(hashes)[0] if hashes else []
        if key is not None:
            block_ids = block_ids[: self.matchable(block_ids, key, current_version)]
        self.hit_blocks += len(block_ids)
        self.miss_blocks += looked_up - len(block_ids)
        if block_ids:
            self.lru_clock += 1
            self.state.retain(block_ids, self.lru_clock)
        return block_ids

    def matchable(self, block_ids: list[int], key: BlockKey, current_version: int | None) -> int:
        """How many leading `block_ids` a request keyed by `key` may read: THE match rule.

        A block is read only if it was registered under `key` (its salt, version and adapter);
        with `current_version` (a request without an explicit version salt) only if those weights
        computed it too. Equal hashes imply both bar a 2^-63 collision; the records make it exact.
        """
        state = self.state
        for count, block_id in enumerate(block_ids):
            if state.key_of(block_id) != key or (
                    current_version is not None and state.computed_by(block_id) != current_version):
                return count
        return len(block_ids)

    def cached_prefix(self, hashes: list[int]) -> list[int]:
        """Blocks of the longest cached prefix of `hashes`, changing nothing (no reference taken)."""
        if not self.enable_prefix_caching or not hashes:
            return []
        return self.registry.match_kv_prefix(hashes)[0]

    def prompt_logprobs_of(self, block_id: int) -> PromptLogprobsBlock | None:
        """The prompt log-probs cached on a registered block, if the request that computed it
        recorded them."""
        return self.state.prompt_logprobs.get(block_id)

    def peek_prefix(self, hashes: list[int], *, key: BlockKey | None = None,
                    current_version: int | None = None) -> tuple[int, int]:
        """(leading blocks of `hashes` cached, how many of them nobody holds), changing nothing.

        Matching a block nobody holds takes it out of the evictable reservoir, so a scheduler
        must subtract the second figure from `available` before counting on fresh blocks. `key`
        and `current_version` as for `match_prefix`.
        """
        if not self.enable_prefix_caching or not hashes:
            return 0, 0
        block_ids = self.registry.match_kv_prefix(hashes)[0]
        if key is not None:
            block_ids = block_ids[: self.matchable(block_ids, key, current_version)]
        unheld = sum(1 for b in block_ids if self.state.ref_count(b) == 0)
        return len(block_ids), unheld

    def register(self, block_ids: BlockIds, hashes: list[int], parent_block_id: int = -1, *,
                 prompt_logprobs: Sequence[PromptLogprobsBlock | None] | None = None,
                 key: BlockKey = UNSALTED_V0, computed_by: int = 0) -> int:
        """Make freshly computed full blocks matchable; returns how many were registered.

        `block_ids` is a run of one request's consecutive full blocks (each the parent of the
        next) and `parent_block_id` the block before the run (-1 at the start of a sequence).
        The run stops at the first block that cannot join the cache: its parent is not
        registered (e.g. after a prefix-cache reset) or not held by the caller, its hash is already served by another
        block (computed twice concurrently; the copy stays private and is freed on release), or
        it was registered before. Stored events wait for `events.publish_pending()`. A hash
        <= 0 is a caller bug: ValueError, nothing changed. `prompt_logprobs[i]`, if given, is
        cached with block i (see `PromptLogprobsBlock`); call only after the forward pass that
        computed the blocks (and their scores) succeeded. `key` is the chain's key (the one
        `hashes` were computed under) and `computed_by` the version of the weights that ran it:
        both are recorded per block and announced with the stored event.
        """
        run = BlockRun(_as_list(block_ids), list(hashes), parent_block_id, key, prompt_logprobs)
        return self.register_runs([run], computed_by=computed_by)[0]

    def register_runs(self, runs: Sequence[BlockRun], *, computed_by: int = 0) -> list[int]:
        """`register` for several requests' runs at once (an engine step's), in order: a run sees
        the hashes of the runs before it. Stops after the first run registered short (its count is
        the last returned), so that the caller can act on it before the runs after it go; returns
        one count per run handled. ValueError, nothing changed, if any run is malformed.
        """
        for run in runs:
            if len(run.block_ids) != len(run.hashes):
                raise ValueError(f"{len(run.block_ids)} block ids but {len(run.hashes)} hashes")
        ids = [b for run in runs for b in run.block_ids]
        hashes = [h for run in runs for h in run.hashes]
        if hashes and min(hashes) <= 0:
            raise ValueError(f"register: hashes must be positive (0 = no parent, -1 = unset), got {hashes}")
        if not self.enable_prefix_caching:
            return [0] * len(runs)
        state, registry = self.state, self.registry
        run_parents = [run.parent_block_id for run in runs]
        if state.all_registrable(ids, hashes, run_parents, registry.kv_hash_to_block_id):
            state.stamp_all(ids, hashes)  # NOTE: the common case (a step's decodes), checked at once
            registry.register_kv(ids, hashes)
            counts = [len(run.block_ids) for run in runs]
            if counts and min(counts) == 1 and len(ids) == len(runs):  # NOTE: one block each: its parent is its run's
                self._record_new_blocks(runs, counts, ids, run_parents, [run.key for run in runs], computed_by)
                return counts
        else:
            counts = []
            for run in runs:
                count = state.stamp_registrable(run.block_ids, run.hashes, run.parent_block_id,
                                                registry.kv_hash_to_block_id)
                registry.register_kv(run.block_ids[:count], run.hashes[:count])
                counts.append(count)
                if count < len(run.block_ids):
                    break
        new_ids: list[int] = []
        parents: list[int] = []
        keys: list[BlockKey] = []
        for run, count in zip(runs, counts):
            run_ids = run.block_ids[:count]
            new_ids += run_ids
            parents += [run.parent_block_id, *run_ids[:-1]][:count]
            keys += [run.key] * count
        self._record_new_blocks(runs, counts, new_ids, parents, keys, computed_by)
        return counts

    def _record_new_blocks(self, runs: Sequence[BlockRun], counts: list[int], new_ids: list[int],
                           parents: list[int], keys: list[BlockKey], computed_by: int) -> None:
        """What blocks just registered (the first `counts[i]` of `runs[i]`) carry besides their hash:
        parent, key, version, prompt scores; and their stored events."""
        state = self.state
        if not new_ids:
            return
        state.record_parent_chain(new_ids, parents)
        if any(run.prompt_logprobs is not None for run in runs):
            scores = [s for run, count in zip(runs, counts)
                      for s in ([None] * count if run.prompt_logprobs is None else run.prompt_logprobs[:count])]
            state.attach_prompt_logprobs(new_ids, scores)
        else:
            state.attach_prompt_logprobs(new_ids, None)
        state.record_keys(new_ids, keys, computed_by)
        if self.events.enabled:  # NOTE: the event is built only for someone to hear it (a per-step cost)
            for run, count in zip(runs, counts):
                if count:
                    parent = run.parent_block_id
                    parent_hash = state.hash_of(parent) if parent >= 0 else NO_PARENT
                    self.events.queue_stored(BlockStored(tuple(run.hashes[:count]), parent_hash,
                                                         tuple(run.block_ids[:count]), self.block_size,
                                                         run.key.salt, run.key.version, computed_by))

    def adopt(self, block_hash: int, own_block: int) -> int | None:
        """The caller computed `own_block` (unregistered) for a hash another block serves: it holds
        the serving block instead (one more reference) and drops its own. Returns the serving
        block, or None (nothing changed). The caller's blocks before it must be the hash chain's
        registered ancestors, so that it still holds a prefix-closed chain."""
        served = self.registry.kv_hash_to_block_id.get(block_hash) if self.enable_prefix_caching else None
        if served is None or served == own_block or self.state.hash_of(own_block) != UNSET_HASH:
            return None
        self.lru_clock += 1
        self.state.retain([served], self.lru_clock)
        self.release([own_block])
        return served

    def offer_prompt_logprobs(self, hashes: list[int], blocks: Sequence[PromptLogprobsBlock | None]) -> int:
        """Scores computed for blocks whose hashes another block already serves (a request that
        recomputed cached KV to get its prompt log-probs): cache each with the registered block
        if it serves more than what that block carries (more alternatives or more valid slots).

        Returns how many leading `hashes` are registered; the caller stops offering after a gap.
        Same hash, same version, same tokens: the scores are those of the registered block too.
        """
        table, cached = self.registry.kv_hash_to_block_id, self.state.prompt_logprobs
        for count, (h, new) in enumerate(zip(hashes, blocks)):
            block_id = table.get(h)
            if block_id is None:
                return count
            old = cached.get(block_id)
            if new is not None and (old is None or _serves_more(new, old)):
                cached[block_id] = new
        return len(hashes)

    def reset_prefix_cache(self) -> None:
        """Make every cached hash unmatchable now, whether or not requests hold the blocks.

        Held blocks stay with their owners, unregistered, and go to the free pool on release;
        cached zero-reference blocks go to the free pool at once.
        """
        cached = self.state.detach_all()
        self.registry.reset()
        self._free.extend(cached)
        self._demoted.clear()
        self.events.all_cleared()
        logger.debug("prefix cache reset: %d cached blocks freed", len(cached))

    def drop_key_versions(self, versions: set[int]) -> int:
        """Make every block keyed by one of `versions` unmatchable now (held or not), as
        `reset_prefix_cache` does for all; zero-reference ones go to the free pool. Returns how many
        blocks were deregistered."""
        if not versions:
            return 0
        free, hashes = self.state.detach_blocks(self.state.registered_ids(versions))
        self._drop_from_registry(hashes)
        self._free.extend(free)
        return len(hashes)

    def demote_key_versions(self, versions: set[int]) -> None:
        """Blocks keyed by `versions` (no live user left, none to come: a version never gets new
        users once it is not the current one) are evicted before any other, now and when released."""
        if versions:
            self.state.demote(self.state.registered_ids(versions))
            self._demoted |= versions
        self._demoted &= set(self.blocks_by_version())  # NOTE: forget versions with no block left

    def blocks_by_version(self) -> dict[int, int]:
        """Registered blocks per key version."""
        return self.state.blocks_by_key_version()

    def reset(self) -> None:
        """Forget everything: all blocks free, no hashes, counters kept (a fresh context)."""
        self.state.reset()
        self.registry.reset()
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._demoted.clear()
        self.events.all_cleared()

    def _drop_from_registry(self, hashes: list[int]) -> None:
        # NOTE: under REF_ZERO `hashes` lists -1 for each unregistered block; evict_kv skips those.
        if hashes:
            removed = self.registry.evict_kv(hashes)
            if removed:
                self.events.blocks_removed(removed)


def _serves_more(new: PromptLogprobsBlock, old: PromptLogprobsBlock) -> bool:
    new_valid, old_valid = int(new.valid.sum()), int(old.valid.sum())
    return new.top_n >= old.top_n and new_valid >= old_valid and (new.top_n, new_valid) != (old.top_n, old_valid)
