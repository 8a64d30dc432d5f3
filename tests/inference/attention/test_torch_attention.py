"""The torch backend against a naive per-request attention, on random mixed batches.

Hypothesis draws the batch: per request a KV history already in the cache (context), a number
of new query rows (1 = decode), the block size and GQA shape; blocks are handed out shuffled and
the requests appear in random order, so decode and prefill rows interleave in the flat batch.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference import native as native_kernels
from inference.attention.metadata import AttentionMetadata
from inference.attention.torch_backend import TorchAttentionBackend
from inference.cache.kv_buffer import KVCacheBuffer
from tests.inference.native_util import kernels_on


def naive_attention(q, k, v, scale):
    """q `[L, Hq, D]` at the last L positions of k/v `[S, Hkv, D]`; causal; fp64."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    n_q, n_kv = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    allowed = torch.arange(n_kv)[None, :] <= (n_kv - n_q + torch.arange(n_q))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_case(contexts, new_lens, block_size, num_kv_heads, group, head_dim=8, seed=0, layer=1, native=True):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_heads = num_kv_heads * group
    totals = [c + n for c, n in zip(contexts, new_lens)]
    need = sum(-(-t // block_size) for t in totals)
    cache = KVCacheBuffer(2, need + 3, block_size, num_kv_heads, head_dim)
    free = list(range(need + 3))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-t // block_size))] for t in totals]
    full_k = [torch.randn(t, num_kv_heads, head_dim, generator=g) for t in totals]
    full_v = [torch.randn(t, num_kv_heads, head_dim, generator=g) for t in totals]
    queries = [torch.randn(n, num_heads, head_dim, generator=g) for n in new_lens]

    def slots(r, positions):
        return torch.tensor([tables[r][p // block_size] * block_size + p % block_size for p in positions])

    # history (context) written directly; this step's rows go through the backend
    for r, c in enumerate(contexts):
        if c:
            cache.store(layer, slots(r, range(c)), full_k[r][:c], full_v[r][:c])
    order = list(range(len(totals)))
    rng.shuffle(order)
    meta = AttentionMetadata.build(
        [new_lens[r] for r in order],
        [totals[r] for r in order],
        [tables[r] for r in order],
        block_size,
        pad_block_id=-1,
    )
    q = torch.cat([queries[r] for r in order])
    k = torch.cat([full_k[r][contexts[r] :] for r in order])
    v = torch.cat([full_v[r][contexts[r] :] for r in order])
    # the kernel is used wherever it can be built, whatever ROLLOUT_ENGINE_NO_KERNELS says
    native = native and native_kernels.compiler() is not None
    with kernels_on() if native else contextlib.nullcontext():
        backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, native_decode=native)
        assert backend.native_decode == native
        backend.plan(meta, cache)
        out = backend.forward(layer, q, k, v, cache).view(-1, num_heads, head_dim)
    start = 0
    for r in order:
        expected = naive_attention(queries[r], full_k[r], full_v[r], head_dim**-0.5)
        got = out[start : start + new_lens[r]]
        # NOTE: |out| < 3, |scores| < 4 (D = 8): a few fp32 ulps (1.2e-7 relative) through the dot
        # products, exp and the softmax sums, ~1e-6; measured max 5e-7. 1e-5 + 1e-5 |x| leaves 10x.
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
        start += new_lens[r]


requests = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(
    reqs=requests,
    block_size=st.sampled_from([1, 4, 16]),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
    native=st.booleans(),
)
def test_matches_naive_attention(reqs, block_size, kv_heads, group, seed, native):
    # native: decode rows through the C kernel (when it builds here); else the gather + SDPA path
    run_case([c for c, _ in reqs], [n for _, n in reqs], block_size, kv_heads, group, seed=seed, native=native)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("new_lens", [[1, 1, 1], [5, 3], [1, 7, 1, 2]])
def test_decode_only_prefill_only_and_mixed(new_lens, native):
    run_case([10, 0, 33, 4][: len(new_lens)], new_lens, block_size=4, num_kv_heads=2, group=2, native=native)


def test_writes_kv_at_slot_mapping():
    cache = KVCacheBuffer(1, 4, 2, 1, 4)
    meta = AttentionMetadata.build([3], [3], [[2, 0]], block_size=2)
    backend = TorchAttentionBackend(1, 1, 4)
    backend.plan(meta, cache)
    k = torch.arange(12.0).view(3, 1, 4)
    backend.forward(0, torch.zeros(3, 1, 4), k, -k, cache)
    assert torch.equal(cache.layer(0)[0, 2].reshape(2, 4), k[:2, 0])
    assert torch.equal(cache.layer(0)[1, 0, 0, 0], -k[2, 0])


def test_forward_before_plan_raises():
    backend = TorchAttentionBackend(2, 1, 4)
    with pytest.raises(RuntimeError, match="before plan"):
        backend.forward(0, torch.zeros(1, 2, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_the_kernel_a_prefill_row_is_the_same_bits_as_that_token_decoded_alone(dtype):
    """Each row of a prefill (or a later chunk) attends as a decode row of its own through the native
    kernel: the same bits as a step that decodes that token alone, whatever else the step holds."""
    if native_kernels.compiler() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    cache = KVCacheBuffer(1, 24, bs, kv_heads, dim, dtype)
    tables = [[5, 1, 9, 2, 14], [3, 7, 11, 0, 20]]
    context, new = [6, 0], [9, 13]
    q = torch.randn(sum(new), heads, dim, generator=g).to(dtype)
    k, v = (torch.randn(sum(new), kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    history = torch.randn(context[0], kv_heads, dim, generator=g).to(dtype)
    cache.store(0, torch.tensor([tables[0][p // bs] * bs + p % bs for p in range(context[0])]), history, history)
    with kernels_on():
        backend = TorchAttentionBackend(heads, kv_heads, dim, dtype=dtype)
        assert backend.native_decode
        backend.plan(AttentionMetadata.build(new, [c + n for c, n in zip(context, new)], tables, bs), cache)
        both = backend.forward(0, q, k, v, cache)
        start = 0
        for r in range(2):
            for i in range(new[r]):
                row = start + i
                backend.plan(AttentionMetadata.build([1], [context[r] + i + 1], [tables[r]], bs), cache)
                alone = backend.forward(0, q[row:row + 1], k[row:row + 1], v[row:row + 1], cache)
                assert torch.equal(alone[0], both[row]), (r, i)
            start += new[r]
