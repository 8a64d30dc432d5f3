"""The native CPU decode kernel: built on this machine, equal to the pure-torch path, optional."""

from __future__ import annotations

import pytest
import torch

from inference import native as native_kernels
from inference.attention.metadata import AttentionMetadata
from inference.attention.torch_backend import TorchAttentionBackend
from inference.kv_cache.buffers import KVCacheBuffer

needs_kernel = pytest.mark.skipif(not native_kernels.available(), reason="no C compiler on this machine")


def decode_step(dtype, native, lens=(1, 16, 17, 63, 200), heads=(8, 2), head_dim=64, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    blocks = [-(-n // block_size) for n in lens]
    cache = KVCacheBuffer(1, sum(blocks) + 2, block_size, num_kv_heads, head_dim, dtype=dtype)
    cache.data.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    ids = torch.randperm(sum(blocks) + 2, generator=g).tolist()
    tables = [[ids.pop() for _ in range(b)] for b in blocks]
    meta = AttentionMetadata.build([1] * len(lens), list(lens), tables, block_size, pad_block_id=-1)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(len(lens), num_kv_heads, head_dim, generator=g).to(dtype)
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, dtype=dtype, native_decode=native)
    assert backend.native_decode == native
    backend.plan(meta, cache)
    return backend.forward(0, q, k, -k, cache)


@needs_kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_native_decode_equals_the_torch_path(dtype, tol):
    native, reference = decode_step(dtype, True), decode_step(dtype, False)
    assert native.dtype == dtype
    torch.testing.assert_close(native.float(), reference.float(), atol=tol, rtol=tol)


@needs_kernel
def test_native_decode_sees_every_query_head_group():
    for heads in [(4, 4), (4, 1), (16, 2)]:
        torch.testing.assert_close(decode_step(torch.float32, True, heads=heads, head_dim=32),
                                   decode_step(torch.float32, False, heads=heads, head_dim=32), atol=2e-6, rtol=2e-6)


def test_without_kernels_the_torch_path_serves(monkeypatch):
    monkeypatch.setenv("ROLLOUT_ENGINE_NO_KERNELS", "1")
    native_kernels.library.cache_clear()
    try:
        assert not native_kernels.available()
        backend = TorchAttentionBackend(4, 2, 16)
        assert not backend.native_decode
    finally:
        monkeypatch.delenv("ROLLOUT_ENGINE_NO_KERNELS")
        native_kernels.library.cache_clear()


def test_the_kernel_is_cached_per_machine(tmp_path, monkeypatch):
    if not native_kernels.available():
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("ROLLOUT_ENGINE_CACHE", str(tmp_path))
    built = native_kernels._build(native_kernels.shutil.which("cc") or "gcc")
    assert built.exists() and tmp_path in built.parents
    assert native_kernels._build(native_kernels.shutil.which("cc") or "gcc") == built  # the second call reuses it


@needs_kernel
def test_loading_the_kernel_keeps_ieee_subnormals():
    # a library linked with -ffast-math would turn on flush-to-zero for the whole process
    assert native_kernels.available()
    tiny = torch.tensor(torch.finfo(torch.float32).tiny)
    assert (tiny / 4).item() > 0.0
