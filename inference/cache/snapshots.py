"""Snapshots of per-request state at KV block boundaries: the Mamba side of the prefix cache.

Recurrent state is cumulative, so a cached KV prefix is only usable by a hybrid model together
with the state after exactly that prefix. A snapshot is a copy of a request's state rows taken
when a prefill chunk ended on a block boundary; it is registered in the prefix-cache registry's
Mamba map under that block's hash (the value is the KV block id serving the hash, as the seed's
registry has it) and lives in a pool of its own, with its own budget and LRU order.

Life cycle: `save` after the forward that computed the state (evicting the least recently used
snapshot when the budget is full), `restore` into a new request's state rows at admission, and
release when the registry drops the entry: a KV eviction cascades to the Mamba map and its
callback frees the slot here; a registry reset fires no callback, so the owner calls `clear()`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from inference.cache.specs import StateSpec
from inference.cache.state_pool import StatePool
from inference.kv_cache.registry import PrefixCacheRegistry


class StateSnapshots:
    """Snapshot slots keyed by the registry's Mamba entries (see module docstring).

    Invariants: a slot is free or holds exactly one snapshot; a held slot's `(block, hash)` is a
    live Mamba entry of the registry, except between a registry reset and the `clear()` that
    follows it (and `_take_slot` reclaims such orphans should a caller forget); `_lru` lists the
    held slots, least recently used first.
    """

    def __init__(self, specs: Sequence[StateSpec], num_slots: int, device: torch.device,
                 registry: PrefixCacheRegistry, *, allocate: bool = True) -> None:
        self.pool = StatePool(specs, num_slots, device, allocate=allocate)
        self.registry = registry
        registry.set_mamba_evict_callback(self._on_evicted)
        self._slot_of_block: dict[int, int] = {}
        self._lru: OrderedDict[int, tuple[int, int]] = OrderedDict()  # slot -> (block id, hash)
        self.saved = 0
        self.restored = 0
        self.evicted = 0  # dropped for the budget or with their KV block

    # ---- queries -----------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def held(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def slot_of(self, block_hash: int) -> int | None:
        """The slot holding the snapshot registered under `block_hash`, or None."""
        block = self.registry.mamba_hash_to_block_id.get(block_hash)
        slot = None if block is None else self._slot_of_block.get(block)
        return slot if slot is not None and self._lru[slot][1] == block_hash else None

    # ---- save / restore ----------------------------------------------------------------------

    def save(self, src: StatePool, src_slot: int, block_id: int, block_hash: int) -> bool:
        """Snapshot `src`'s row `src_slot` as the state after KV block `block_id` (hash
        `block_hash`, which the registry's KV map must serve). False if one is already cached."""
        if self.slot_of(block_hash) is not None:
            self._lru.move_to_end(self._slot_of_block[self.registry.mamba_hash_to_block_id[block_hash]])
            return False
        if self.registry.kv_hash_to_block_id.get(block_hash) != block_id:
            raise ValueError(f"snapshot for hash {block_hash}: KV block {block_id} does not serve it")
        slot = self._take_slot()
        if slot is None:
            return False
        for name, t in self.pool.tensors.items():
            t[slot].copy_(src.tensors[name][src_slot])
        self.registry.register_mamba([block_id], [block_hash])
        self._slot_of_block[block_id] = slot
        self._lru[slot] = (block_id, block_hash)
        self.saved += 1
        return True

    def restore(self, block_hash: int, dst: StatePool, dst_slot: int) -> bool:
        """Copy the snapshot under `block_hash` into `dst`'s row `dst_slot`; False if none."""
        slot = self.slot_of(block_hash)
        if slot is None:
            return False
        for name, t in dst.tensors.items():
            t[dst_slot].copy_(self.pool.tensors[name][slot])
        self._lru.move_to_end(slot)
        self.restored += 1
        return True

    # ---- release -----------------------------------------------------------------------------

    def _take_slot(self) -> int | None:
        """A free slot, evicting the least recently used snapshot when none is free."""
        if not self.pool.free:
            self._reclaim_orphans()
        while not self.pool.free and self._lru:
            slot, (_, block_hash) = next(iter(self._lru.items()))
            if not self.registry.evict_mamba([block_hash]):  # NOTE: the callback frees the slot
                self._free(slot)
        return self.pool.allocate_slot(zero=False)

    def _on_evicted(self, block_ids: list[int]) -> None:
        """Registry callback: these blocks' Mamba entries are gone (budget, KV eviction, clear)."""
        for block in block_ids:
            slot = self._slot_of_block.get(block)
            if slot is not None:
                self._free(slot)
                self.evicted += 1

    def _free(self, slot: int) -> None:
        block, _ = self._lru.pop(slot)
        if self._slot_of_block.get(block) == slot:
            del self._slot_of_block[block]
        self.pool.free_slot(slot)

    def _reclaim_orphans(self) -> None:
        """Free slots whose registry entry vanished without a callback (a reset nobody cleared)."""
        live = self.registry.mamba_hash_to_block_id
        for slot in [s for s, (block, h) in self._lru.items() if live.get(h) != block]:
            self._free(slot)

    def clear(self) -> None:
        """Drop every snapshot (a prefix-cache reset or release); the registry's remaining Mamba
        entries go too."""
        self.registry.clear_mamba()  # NOTE: fires the callback for entries still registered
        for slot in list(self._lru):
            self._free(slot)

    # ---- memory ------------------------------------------------------------------------------

    def allocate(self) -> None:
        self.pool.allocate()

    def deallocate(self) -> None:
        self.clear()
        self.pool.deallocate()

    def stats(self) -> dict:
        return {"state_snapshot_slots": self.num_slots, "state_snapshots_held": self.held,
                "state_snapshots_saved": self.saved, "state_snapshots_restored": self.restored,
                "state_snapshots_evicted": self.evicted, "state_snapshot_bytes": self.nbytes}
