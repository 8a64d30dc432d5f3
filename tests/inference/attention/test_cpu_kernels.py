"""The native CPU decode kernel: built on this machine, equal to float64 attention like the torch path, optional."""

from __future__ import annotations

import pytest
import torch

from inference import native as native_kernels
from inference.attention.metadata import AttentionMetadata
from inference.attention.torch_backend import TorchAttentionBackend
from inference.cache.kv_buffer import KVCacheBuffer
from tests.inference.native_util import needs_compiler

# (atol, rtol) against float64 attention of the same inputs, by (dtype, native kernel or torch path).
# NOTE: fp32: |out| < 3 (a convex mix of N(0, 1) values), |scores| < 6 over <= 200 keys; the D = 64
# dot products, exp and the softmax sums cost a few ulps (1.2e-7 relative) each: 2e-6. Measured max
# 4.6e-7 (kernel, native and v2 builds), 6.9e-7 (torch, any ATEN_CPU_CAPABILITY).
# bf16: the kernel works in fp32 and rounds the output once: half an ulp is <= 2^-8 relative. Torch's
# SDPA also rounds each probability to bf16 (2^-9 relative) before P @ V: <= 2^-9 max|v| = 9e-3 more.
# Measured max |error| 3.9e-3 (kernel; its output is the float64 one rounded), 4.4e-3 (torch).
TOLERANCES = {
    (torch.float32, True): (2e-6, 0.0), (torch.float32, False): (2e-6, 0.0),
    (torch.bfloat16, True): (1e-5, 2**-8), (torch.bfloat16, False): (9e-3, 2**-8),
}


def decode_step(dtype, native, lens=(1, 16, 17, 63, 200), heads=(8, 2), head_dim=64, block_size=16, seed=0):
    """(the backend's decode output `[B, Hq * D]`, the float64 attention of the same q and cache)."""
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
    out = backend.forward(0, q, k, -k, cache)
    kv = cache.layer(0).double()  # [2, blocks, bs, Hkv, D], this step's k / -k stored
    group = num_heads // num_kv_heads
    want = []
    for b, (n, table) in enumerate(zip(lens, tables)):
        keys, values = (kv[i, table].reshape(-1, num_kv_heads, head_dim)[:n].repeat_interleave(group, 1)
                        for i in (0, 1))
        scores = torch.einsum("hd,khd->hk", q[b].double(), keys) * head_dim**-0.5
        want.append(torch.einsum("hk,khd->hd", scores.softmax(-1), values).reshape(-1))
    return out, torch.stack(want)


@needs_compiler
@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_equals_float64_attention_like_the_torch_path(dtype):
    for native in (True, False):
        out, want = decode_step(dtype, native)
        assert out.dtype == dtype
        atol, rtol = TOLERANCES[dtype, native]
        torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)


@needs_compiler
@pytest.mark.usefixtures("native_kernels")
def test_native_decode_sees_every_query_head_group():
    for heads in [(4, 4), (4, 1), (16, 2)]:
        out, want = decode_step(torch.float32, True, heads=heads, head_dim=32)
        torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=0)  # NOTE: see TOLERANCES



@needs_compiler
@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("head_dim, block_size", [(128, 16), (24, 16), (64, 5), (64, 12), (16, 32)])
def test_native_decode_at_every_head_size_and_block_size(head_dim, block_size):
    # 64, 128 and 32 run copies specialised for their size, others the general one; chunks of eight
    # tokens are cut short by blocks of 5 and 12 and by every length in `lens`
    for dtype in (torch.float32, torch.bfloat16):
        out, want = decode_step(dtype, True, head_dim=head_dim, block_size=block_size, lens=(1, 7, 9, 40, 130))
        atol, rtol = TOLERANCES[dtype, True]
        torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)


@needs_compiler
@pytest.mark.usefixtures("native_kernels")
def test_a_requests_output_is_the_same_bits_in_any_batch():
    # each request is attended on its own: alone or beside others, on any number of threads, the
    # same bits (what lets a verify step's tokens match the decode steps they stand in for)
    from inference.attention import cpu_kernels

    g = torch.Generator().manual_seed(3)
    lens, block_size, heads, head_dim = [3, 33, 100, 17, 64], 16, 9, 64
    k_cache, v_cache = (torch.randn(40, block_size, 3, head_dim, generator=g) for _ in range(2))
    tables = torch.randperm(40, generator=g)[:35].view(5, 7).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(5, heads, head_dim, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.125, torch.empty(5, heads, head_dim))
        torch.set_num_threads(1)
        for i in range(5):
            alone = cpu_kernels.paged_decode(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], seq_lens[i:i + 1], 0.125,
                                             torch.empty(1, heads, head_dim))
            assert torch.equal(alone[0], batch[i])
    finally:
        torch.set_num_threads(threads)


@needs_compiler
@pytest.mark.usefixtures("native_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_read_in_place_and_a_bf16_output_rounded_in_the_kernel_are_the_same_bits(dtype):
    # the backend hands the kernel q as a view of the step's q, k and v side by side (rows farther
    # apart than their heads), and for bf16 takes a bf16 output: each the same bits as a contiguous
    # copy of q and a float32 output rounded by torch after
    from inference.attention import cpu_kernels

    g = torch.Generator().manual_seed(5)
    lens, block_size, heads, head_dim = [3, 33, 100, 17, 64], 16, 9, 64
    k_cache, v_cache = (torch.randn(40, block_size, 3, head_dim, generator=g).to(dtype) for _ in range(2))
    tables = torch.randperm(40, generator=g)[:35].view(5, 7).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qkv = torch.randn(5, (heads + 6) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(5, heads, head_dim)
    assert q.stride(0) == (heads + 6) * head_dim
    want = cpu_kernels.paged_decode(q.contiguous(), k_cache, v_cache, tables, seq_lens, 0.125,
                                    torch.empty(5, heads, head_dim))
    got = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.125, torch.empty(5, heads, head_dim))
    assert torch.equal(got, want)
    if dtype == torch.bfloat16:
        rounded = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, seq_lens, 0.125,
                                           torch.empty(5, heads, head_dim, dtype=dtype))
        assert rounded.dtype == dtype and torch.equal(rounded, want.to(dtype))


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


@needs_compiler
def test_the_kernel_is_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_ENGINE_CACHE", str(tmp_path))
    cc, arch = native_kernels.compiler(), native_kernels.target_arch()
    built = native_kernels._build(cc, arch)
    assert built.exists() and tmp_path in built.parents
    assert native_kernels._build(cc, arch) == built  # the second call reuses it


@needs_compiler
@pytest.mark.usefixtures("native_kernels")
def test_loading_the_kernel_keeps_ieee_subnormals():
    # a library linked with -ffast-math would turn on flush-to-zero for the whole process
    assert native_kernels.available()
    tiny = torch.tensor(torch.finfo(torch.float32).tiny)
    assert (tiny / 4).item() > 0.0
