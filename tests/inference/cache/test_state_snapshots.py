"""StateSnapshots with the prefix-cache registry: save / restore, its own LRU budget, eviction
cascading from KV, resets; and a property-based machine of all of it against a plain model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inference.cache.snapshots import StateSnapshots
from inference.cache.specs import StateSpec
from inference.cache.state_pool import StatePool
from inference.kv_cache.registry import PrefixCacheRegistry

SPECS = [StateSpec("conv", (2, 3), torch.float32), StateSpec("ssm", (4,), torch.float32)]


def make(num_slots: int = 2):
    registry = PrefixCacheRegistry()
    return registry, StateSnapshots(SPECS, num_slots, torch.device("cpu"), registry), StatePool(SPECS, 4, "cpu")


def fill(pool: StatePool, slot: int, value: float) -> None:
    for t in pool.tensors.values():
        t[slot] = value


def value_of(pool: StatePool, slot: int) -> float:
    values = {float(t[slot].flatten()[0]) for t in pool.tensors.values()}
    assert len(values) == 1
    return values.pop()


def test_save_and_restore_round_trip():
    registry, snaps, src = make()
    registry.register_kv([7], [101])
    fill(src, 0, 3.0)
    assert snaps.save(src, 0, 7, 101) and registry.mamba_hash_to_block_id == {101: 7}
    assert not snaps.save(src, 0, 7, 101)  # already cached
    fill(src, 1, 0.0)
    assert snaps.restore(101, src, 1) and value_of(src, 1) == 3.0
    assert not snaps.restore(999, src, 1)
    with pytest.raises(ValueError, match="does not serve"):
        snaps.save(src, 0, 8, 102)  # no KV block serves 102


def test_the_budget_evicts_the_least_recently_used():
    registry, snaps, src = make(num_slots=2)
    registry.register_kv([1, 2, 3], [11, 12, 13])
    snaps.save(src, 0, 1, 11)
    snaps.save(src, 0, 2, 12)
    snaps.restore(11, src, 1)  # 11 is now the most recently used
    snaps.save(src, 0, 3, 13)
    assert set(registry.mamba_hash_to_block_id) == {11, 13} and snaps.evicted == 1
    assert set(registry.kv_hash_to_block_id) == {11, 12, 13}  # the KV entry stays


def test_kv_eviction_cascades_and_reset_is_cleared():
    registry, snaps, src = make(num_slots=2)
    registry.register_kv([1, 2], [11, 12])
    snaps.save(src, 0, 1, 11)
    snaps.save(src, 0, 2, 12)
    registry.evict_kv([11])
    assert snaps.held == 1 and snaps.pool.free == 1 and snaps.slot_of(11) is None
    registry.reset()  # fires no callback: the slot is an orphan until cleared (or reclaimed)
    assert snaps.held == 1
    registry.register_kv([3, 4], [13, 14])
    assert snaps.save(src, 0, 3, 13) and snaps.save(src, 0, 4, 14)  # the orphan was reclaimed
    snaps.clear()
    assert snaps.held == 0 and snaps.pool.free == 2 and not registry.mamba_hash_to_block_id


class SnapshotMachine(RuleBasedStateMachine):
    """Random saves, restores, KV evictions and resets; the model is {hash: (block, value)}."""

    def __init__(self) -> None:
        super().__init__()
        self.registry, self.snaps, self.src = make(num_slots=3)
        self.kv: dict[int, int] = {}  # hash -> block
        self.model: dict[int, tuple[int, float]] = {}
        self.next = 1

    @rule()
    def register_block(self):
        h, block = 100 + self.next, self.next
        self.next += 1
        self.registry.register_kv([block], [h])
        self.kv[h] = block

    @precondition(lambda self: self.kv)
    @rule(data=st.data(), value=st.integers(-5, 5))
    def save(self, data, value):
        h = data.draw(st.sampled_from(sorted(self.kv)))
        fill(self.src, 0, value)
        saved = self.snaps.save(self.src, 0, self.kv[h], h)
        assert saved == (h not in self.model)
        if saved:
            if len(self.model) == 3:  # the least recently used goes
                self.model.pop(self.lru_first())
            self.model[h] = (self.kv[h], value)
        self.touch(h)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def restore(self, data):
        h = data.draw(st.sampled_from(sorted(self.model)))
        assert self.snaps.restore(h, self.src, 2) and value_of(self.src, 2) == self.model[h][1]
        self.touch(h)

    @precondition(lambda self: self.kv)
    @rule(data=st.data())
    def evict_kv(self, data):
        h = data.draw(st.sampled_from(sorted(self.kv)))
        self.registry.evict_kv([h])
        del self.kv[h]
        self.model.pop(h, None)

    @rule(clear=st.booleans())
    def reset(self, clear):
        self.registry.reset()
        if clear:
            self.snaps.clear()
        self.kv.clear()
        self.model.clear()

    def touch(self, h):
        self.order = [x for x in getattr(self, "order", []) if x != h] + [h]

    def lru_first(self):
        return next(h for h in getattr(self, "order", []) if h in self.model)

    @invariant()
    def agrees_with_the_model(self):
        assert self.registry.mamba_hash_to_block_id == {h: b for h, (b, _) in self.model.items()}
        for h in self.model:
            assert self.snaps.slot_of(h) is not None
        live = {(b, h) for h, (b, _) in self.model.items()}
        assert live <= set(self.snaps._lru.values()) and self.snaps.held + self.snaps.pool.free == 3


TestSnapshotMachine = SnapshotMachine.TestCase
TestSnapshotMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
