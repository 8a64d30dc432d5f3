"""KVCacheBuffer (`inference/cache/kv_buffer.py`): layout, slot writes, block copies,
offload/restore, (de)allocation."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inference import native
from inference.cache.kv_buffer import KVCacheBuffer
from tests.inference.native_util import SWITCH, kernels_on, needs_compiler

L, NB, BS, H, D = 2, 6, 4, 2, 3


def test_layout_and_sizes():
    buf = KVCacheBuffer(L, NB, BS, H, D, torch.float16)
    assert buf.data.shape == (L, 2, NB, BS, H, D)
    assert buf.layer(1).shape == (2, NB, BS, H, D)
    assert buf.nbytes == L * 2 * NB * BS * H * D * 2 == buf.data.nbytes
    assert buf.is_allocated and torch.count_nonzero(buf.data) == 0  # zero-filled: finite everywhere


def test_deallocate_drops_storage_and_refuses_access():
    buf = KVCacheBuffer(L, NB, BS, H, D)
    buf.deallocate()
    assert not buf.is_allocated and buf.nbytes > 0
    with pytest.raises(RuntimeError, match="not allocated"):
        buf.layer(0)
    buf.allocate()
    assert buf.is_allocated
    lazy = KVCacheBuffer(L, NB, BS, H, D, allocate=False)
    assert not lazy.is_allocated


def test_store_follows_slot_formula():
    buf = KVCacheBuffer(L, NB, BS, H, D)
    table = [4, 1]
    positions = torch.arange(6)
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in positions.tolist()])
    k = torch.randn(6, H, D)
    buf.store(1, slots, k, 2 * k)
    for p in range(6):
        assert torch.equal(buf.data[1, 0, table[p // BS], p % BS], k[p])
        assert torch.equal(buf.data[1, 1, table[p // BS], p % BS], 2 * k[p])
    assert torch.count_nonzero(buf.data[0]) == 0


@needs_compiler
@pytest.mark.parametrize("source", ["contiguous", "strided", "empty", "other dtype"])
def test_store_native_rows_equal_index_copy(source, monkeypatch):
    """The native row copy (csrc/store_rows.c) writes what index_copy_ writes, slots in any order,
    from rows of a wider projection output (strided) too; another dtype is converted by torch."""
    g = torch.Generator().manual_seed(3)
    rows = 0 if source == "empty" else 7
    slots = torch.randperm(NB * BS, generator=g)[:rows]
    kv = torch.randn(rows, 3 * H * D, generator=g)
    if source == "strided":  # NOTE: K and V as a fused projection's columns: rows 3 * H * D apart
        k, v = kv[:, : H * D], kv[:, H * D : 2 * H * D]
    else:
        k, v = kv[:, : H * D].clone(), 2 * kv[:, : H * D]
    k, v = k.view(rows, H, D), v.view(rows, H, D)
    if source == "other dtype":
        k, v = k.double(), v.double()
    with kernels_on():
        native_buf = KVCacheBuffer(L, NB, BS, H, D)
        flat = native_buf.layer(1).view(2, NB * BS, H, D)
        assert native_buf._native_rows(flat, slots, k, v) == (source != "other dtype")
        native_buf.store(1, slots, k, v)
    monkeypatch.setenv(SWITCH, "1")
    native.library.cache_clear()
    try:
        torch_buf = KVCacheBuffer(L, NB, BS, H, D)
        torch_buf.store(1, slots, k, v)
    finally:
        monkeypatch.delenv(SWITCH)
        native.library.cache_clear()
    assert torch.equal(native_buf.data, torch_buf.data)
    assert torch.count_nonzero(native_buf.data) == (0 if rows == 0 else 2 * rows * H * D)


@pytest.mark.parametrize("bad", [dict(num_blocks=0), dict(block_size=-1), dict(dtype=torch.int32)])
def test_rejects_bad_config(bad):
    args = dict(num_layers=L, num_blocks=NB, block_size=BS, num_kv_heads=H, head_dim=D) | bad
    with pytest.raises(ValueError):
        KVCacheBuffer(**args)


def test_copy_blocks_rejects_out_of_range_and_length_mismatch():
    buf = KVCacheBuffer(L, NB, BS, H, D)
    with pytest.raises(IndexError):
        buf.copy_blocks([0], [NB])
    with pytest.raises(ValueError):
        buf.copy_blocks([0, 1], [2])


class BufferMachine(RuleBasedStateMachine):
    """Random block writes / copies / offload-restore / suspend against a dict of blocks."""

    def __init__(self):
        super().__init__()
        self.buf = KVCacheBuffer(L, NB, BS, H, D)
        self.model = {b: torch.zeros(L, 2, BS, H, D) for b in range(NB)}
        self.parked: list[torch.Tensor] = []

    @rule(block=st.integers(0, NB - 1), seed=st.integers(0, 1000))
    def write_block(self, block, seed):
        g = torch.Generator().manual_seed(seed)
        content = torch.randn(L, 2, BS, H, D, generator=g)
        slots = torch.arange(block * BS, (block + 1) * BS)
        for layer in range(L):
            self.buf.store(layer, slots, content[layer, 0], content[layer, 1])
        self.model[block] = content

    @rule(
        pairs=st.lists(st.tuples(st.integers(0, NB - 1), st.integers(0, NB - 1)), max_size=4, unique_by=lambda p: p[1])
    )
    def copy_blocks(self, pairs):
        self.buf.copy_blocks([s for s, _ in pairs], [d for _, d in pairs])
        before = {b: t.clone() for b, t in self.model.items()}
        for s, d in pairs:  # all sources read before any write
            self.model[d] = before[s]

    @rule(src=st.lists(st.integers(0, NB - 1), min_size=1, max_size=3, unique=True), data=st.data())
    def offload_then_restore_elsewhere(self, src, data):
        host = self.buf.offload(src)
        assert host.device.type == "cpu" and host.shape[2] == len(src)
        dst = data.draw(st.lists(st.integers(0, NB - 1), min_size=len(src), max_size=len(src), unique=True))
        self.buf.restore(dst, host)
        saved = [self.model[b].clone() for b in src]
        for b, t in zip(dst, saved):
            self.model[b] = t

    @precondition(lambda self: self.buf.is_allocated)
    @rule()
    def suspend_resume(self):
        self.buf.deallocate()
        self.buf.allocate()
        self.model = {b: torch.zeros(L, 2, BS, H, D) for b in range(NB)}

    @invariant()
    def matches_model(self):
        for b, t in self.model.items():
            assert torch.equal(self.buf.data[:, :, b], t)


BufferMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=12, deadline=None)
TestBufferMachine = BufferMachine.TestCase


def _mapping_flags(address: int) -> list[str] | None:
    """VmFlags of this process's mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                    reason="needs Linux's /proc/self/smaps and a kernel with transparent huge pages")
def test_the_buffer_is_advised_for_huge_pages_and_still_returned():
    buf = KVCacheBuffer(L, 64, 16, 8, 64)  # 2 MiB and more: room for a huge page
    address = buf.data.data_ptr()
    flags = _mapping_flags(address)
    assert flags is not None and "hg" in flags  # MADV_HUGEPAGE: first touches fault 2 MiB at a time
    buf.deallocate()
    gc.collect()
    assert _mapping_flags(address) is None  # unmapped: the memory went back
