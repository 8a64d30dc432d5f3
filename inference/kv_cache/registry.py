"""The prefix-cache registry: which block holds which hash, for KV blocks and Mamba states.

Torch-free by design: only ints, lists and sets cross its boundary, so it can later live in
another process. Physical state (ref counts, free pool, Mamba slots) stays with its owners, who
call in here when they register or evict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from inference.kv_cache.hashing import NO_PARENT, UNSET_HASH


class PrefixCacheRegistry:
    """Maps block hash -> block id for KV blocks and for Mamba state blocks.

    Invariant (kept by callers that register whole chains): if a KV hash is registered, so is
    every ancestor hash of its chain; a Mamba entry exists only for a registered KV hash.
    """

    __slots__ = ("kv_hash_to_block_id", "mamba_hash_to_block_id", "_mamba_evict_callback")

    def __init__(self) -> None:
        self.kv_hash_to_block_id: dict[int, int] = {}
        self.mamba_hash_to_block_id: dict[int, int] = {}
        self._mamba_evict_callback: Callable[[list[int]], None] | None = None

    def set_mamba_evict_callback(self, cb: Callable[[list[int]], None] | None) -> None:
        """Call `cb(block_ids)` whenever Mamba entries are evicted, so their slots can be freed."""
        self._mamba_evict_callback = cb

    # ---- KV ----------------------------------------------------------------------------------

    def match_kv_prefix(self, hashes: list[int]) -> tuple[list[int], int]:
        """Longest cached prefix of `hashes`: (its block ids, hash of its last block or 0).

        Chained hashes make a backward scan enough: the farthest cached hash implies all before
        it. NOTE: should a caller have broken the chain invariant, the forward gather below stops
        at the first gap instead of returning a block for a hash that is not cached.
        """
        table = self.kv_hash_to_block_id
        farthest = len(hashes) - 1
        while farthest >= 0 and hashes[farthest] not in table:
            farthest -= 1
        block_ids: list[int] = []
        for h in hashes[: farthest + 1]:
            block_id = table.get(h)
            if block_id is None:
                break
            block_ids.append(block_id)
        parent_hash = hashes[len(block_ids) - 1] if block_ids else NO_PARENT
        return block_ids, parent_hash

    def register_kv(self, block_ids: list[int], hashes: list[int]) -> None:
        """Add (hash -> block id) entries in bulk."""
        if len(block_ids) != len(hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(hashes)} hashes")
        for block_id, h in zip(block_ids, hashes):
            if h <= 0:
                raise ValueError(f"cannot register KV block {block_id} under non-positive hash {h}")
            self.kv_hash_to_block_id[h] = block_id

    def evict_kv(self, hashes: Iterable[int]) -> set[int]:
        """Drop the KV entries of `hashes` (ignoring -1); their Mamba entries go with them.

        Returns the hashes actually removed from the KV map.
        """
        table = self.kv_hash_to_block_id
        removed = {h for h in hashes if h != UNSET_HASH and table.pop(h, None) is not None}
        if removed:
            self._cascade_mamba_evict(removed)
        return removed

    def clear_kv(self) -> None:
        """Drop every KV entry (and so every Mamba entry, which cannot outlive its KV block)."""
        self.kv_hash_to_block_id.clear()
        self.clear_mamba()

    # ---- Mamba -------------------------------------------------------------------------------

    def match_mamba_farthest(self, hashes: list[int]) -> int:
        """One past the farthest block of `hashes` with a cached Mamba state; 0 if none.

        Mamba state is cumulative, so only the farthest cached boundary is worth restoring.
        """
        return self.find_mamba_backoff(hashes, len(hashes))

    def find_mamba_backoff(self, hashes: list[int], search_len: int) -> int:
        """Like `match_mamba_farthest`, but only within `hashes[:search_len]`."""
        table = self.mamba_hash_to_block_id
        index = max(0, min(search_len, len(hashes))) - 1
        while index >= 0 and hashes[index] not in table:
            index -= 1
        return index + 1

    def register_mamba(self, block_ids: list[int], hashes: list[int]) -> None:
        """Add (hash -> block id) Mamba entries in bulk; hashes <= 0 (unset, no parent) are skipped."""
        if len(block_ids) != len(hashes):
            raise ValueError(f"{len(block_ids)} block ids but {len(hashes)} hashes")
        for block_id, h in zip(block_ids, hashes):
            if h > 0:
                self.mamba_hash_to_block_id[h] = block_id

    def evict_mamba(self, hashes: Iterable[int]) -> set[int]:
        """Drop the Mamba entries of `hashes` (ignoring -1); the evict callback gets their block ids."""
        table = self.mamba_hash_to_block_id
        removed: set[int] = set()
        freed_block_ids: list[int] = []
        for h in hashes:
            if h == UNSET_HASH:
                continue
            block_id = table.pop(h, None)
            if block_id is not None:
                removed.add(h)
                freed_block_ids.append(block_id)
        if freed_block_ids and self._mamba_evict_callback is not None:
            self._mamba_evict_callback(freed_block_ids)
        return removed

    def _cascade_mamba_evict(self, hashes: set[int]) -> None:
        """A deregistered KV block can never keep a valid Mamba state."""
        if self.mamba_hash_to_block_id:
            self.evict_mamba(hashes)

    def clear_mamba(self) -> None:
        """Drop every Mamba entry, telling the evict callback which block ids lost theirs."""
        freed = list(self.mamba_hash_to_block_id.values())
        self.mamba_hash_to_block_id.clear()
        if freed and self._mamba_evict_callback is not None:
            self._mamba_evict_callback(freed)

    def reset(self) -> None:
        """Drop every entry, KV and Mamba, keeping the evict callback installed.

        NOTE: a reset is not an eviction, so the callback does not fire: whoever owns the Mamba
        state slots frees them all as part of its own reset.
        """
        self.kv_hash_to_block_id.clear()
        self.mamba_hash_to_block_id.clear()
