"""StatePool: slots of per-request state, checked against a plain model by hypothesis."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inference.cache.specs import StateSpec
from inference.cache.state_pool import StatePool

SPECS = [StateSpec("conv", (2, 3), torch.float32), StateSpec("ssm", (4,), torch.float32)]


class StatePoolMachine(RuleBasedStateMachine):
    """Held slots hold what was last written to them; free + held = all; fresh slots are zero."""

    def __init__(self):
        super().__init__()
        self.pool = StatePool(SPECS, 6, torch.device("cpu"))
        self.model: dict[int, float] = {}  # held slot -> the value all its entries hold

    @precondition(lambda self: self.pool.free > 0)
    @rule()
    def allocate(self):
        slot = self.pool.allocate_slot()
        assert slot not in self.model and 0 <= slot < 6
        self.model[slot] = 0.0

    @precondition(lambda self: self.pool.free == 0)
    @rule()
    def allocate_when_full(self):
        assert self.pool.allocate_slot() is None

    @precondition(lambda self: self.model)
    @rule(data=st.data(), value=st.floats(-10, 10))
    def write(self, data, value):
        slot = data.draw(st.sampled_from(sorted(self.model)))
        for t in self.pool.tensors.values():
            t[slot] = value
        self.model[slot] = value

    @precondition(lambda self: len(self.model) >= 2)
    @rule(data=st.data())
    def copy(self, data):
        src, dst = data.draw(st.permutations(sorted(self.model)))[:2]
        self.pool.copy([src], [dst])
        self.model[dst] = self.model[src]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        slot = data.draw(st.sampled_from(sorted(self.model)))
        self.pool.free_slot(slot)
        del self.model[slot]
        with pytest.raises(ValueError):
            self.pool.free_slot(slot)

    @rule()
    def suspend_with_offload(self):
        held = sorted(self.model)
        saved = self.pool.offload(held) if held else None
        self.pool.deallocate()
        self.pool.allocate()
        if saved is not None:
            self.pool.restore(held, saved)

    @invariant()
    def matches_the_model(self):
        assert self.pool.free + len(self.model) == 6 and self.pool.held == len(self.model)
        for slot, value in self.model.items():
            for t in self.pool.tensors.values():
                assert torch.all(t[slot] == value)


TestStatePool = StatePoolMachine.TestCase
TestStatePool.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_sizes_and_scratch_row():
    pool = StatePool(SPECS, 3, torch.device("cpu"))
    assert pool.nbytes == 4 * (6 + 4) * 4  # 3 slots + the scratch row, 10 floats each
    assert pool.tensors["conv"].shape == (4, 2, 3) and pool.scratch == 3
    assert [pool.allocate_slot() for _ in range(4)] == [0, 1, 2, None]  # the scratch row is never handed out
    pool.deallocate()
    with pytest.raises(RuntimeError, match="not allocated"):
        _ = pool.tensors
