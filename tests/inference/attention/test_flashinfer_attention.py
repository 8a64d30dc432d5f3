"""flashinfer backend: its use of the wrapper API on CPU (stand-in module), the kernels on CUDA."""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch

from inference.attention import AttentionBackendKind, AttentionMetadata, select_backend
from inference.attention.flashinfer_backend import FlashInferAttentionBackend, _page_lists
from inference.attention.torch_backend import TorchAttentionBackend
from inference.cache.kv_buffer import KVCacheBuffer

# (context already cached, new rows): decode rows, a fresh prefill, chunks after context
REQS = [(37, 1), (0, 19), (5, 1), (40, 9), (0, 1), (3, 4)]


def test_page_lists_follow_flashinfer_csr_layout():
    tables = torch.tensor([[7, 2, 9], [4, -1, -1], [1, 3, -1]], dtype=torch.int32)
    indptr, indices, last = _page_lists(tables, torch.tensor([0, 2]), torch.tensor([9, 4], dtype=torch.int32), 4)
    assert indptr.tolist() == [0, 3, 4]
    assert indices.tolist() == [7, 2, 9, 1]
    assert last.tolist() == [1, 4]  # 1 <= last_page_len <= page_size
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


class _StandInWrapper:
    """Naive paged attention with the documented semantics of flashinfer's paged wrappers."""

    def __init__(self, workspace, kv_layout="NHD", use_tensor_cores=False):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.causal = None

    def plan(self, *args, causal=False, q_data_type=None, kv_data_type=None, sm_scale=None):
        if len(args) == 8:  # prefill: qo_indptr first
            self.qo_indptr, *args = args
        else:
            self.qo_indptr = None
        self.indptr, self.indices, self.last, self.hq, self.hkv, self.d, self.page = args
        self.causal, self.scale, self.dtypes = causal, sm_scale, (q_data_type, kv_data_type)

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache
        assert k_cache.shape[1:] == (self.page, self.hkv, self.d), "expects NHD pages"
        qo = self.qo_indptr if self.qo_indptr is not None else torch.arange(len(self.last) + 1)
        out = torch.empty_like(q)
        for r in range(len(self.last)):
            pages = self.indices[self.indptr[r] : self.indptr[r + 1]].long()
            n_kv = (len(pages) - 1) * self.page + int(self.last[r])
            k = k_cache[pages].reshape(-1, self.hkv, self.d)[:n_kv].repeat_interleave(self.hq // self.hkv, 1)
            v = v_cache[pages].reshape(-1, self.hkv, self.d)[:n_kv].repeat_interleave(self.hq // self.hkv, 1)
            rows = q[qo[r] : qo[r + 1]]
            # NOTE: in float64, so the torch backend is compared with exact attention (rounded once)
            k, v = k.double(), v.double()
            scores = torch.einsum("qhd,khd->hqk", rows.double(), k) * self.scale
            if self.causal:  # bottom-right aligned, as documented for append attention
                n_q = rows.shape[0]
                allowed = torch.arange(n_kv)[None, :] <= (n_kv - n_q + torch.arange(n_q))[:, None]
                scores = scores.masked_fill(~allowed, float("-inf"))
            out[qo[r] : qo[r + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        return out


def run_both(make_fi, dtype, device, reqs=REQS, block_size=16, heads=8, kv_heads=2, head_dim=128):
    rng = random.Random(0)
    totals = [c + n for c, n in reqs]
    n_blocks = sum(-(-t // block_size) for t in totals) + 4
    free = list(range(n_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-t // block_size))] for t in totals]
    outs = []
    for make in (lambda: TorchAttentionBackend(heads, kv_heads, head_dim, dtype=dtype, device=device), make_fi):
        cache = KVCacheBuffer(1, n_blocks, block_size, kv_heads, head_dim, dtype, device)
        backend = make()
        g = torch.Generator().manual_seed(1)  # same inputs for both backends

        def rand(t, h, g=g):
            return torch.randn(t, h, head_dim, generator=g).to(device, dtype)

        # the context first (as a prefill through the backend), then the step under test
        ctx = [r for r, (c, _) in enumerate(reqs) if c]
        hist = AttentionMetadata.build(
            [reqs[r][0] for r in ctx], [reqs[r][0] for r in ctx], [tables[r] for r in ctx], block_size, device
        )
        backend.plan(hist, cache)
        backend.forward(
            0, rand(hist.num_tokens, heads), rand(hist.num_tokens, kv_heads), rand(hist.num_tokens, kv_heads), cache
        )
        meta = AttentionMetadata.build([n for _, n in reqs], totals, tables, block_size, device, pad_block_id=-1)
        t = meta.num_tokens
        backend.plan(meta, cache)
        outs.append(backend.forward(0, rand(t, heads), rand(t, kv_heads), rand(t, kv_heads), cache).float())
    return outs


@pytest.mark.parametrize("reqs", [REQS, [(4, 1), (9, 1)], [(0, 5), (3, 2)]])
def test_backend_logic_against_stand_in(monkeypatch, reqs):
    fake = types.ModuleType("flashinfer")
    fake.BatchDecodeWithPagedKVCacheWrapper = _StandInWrapper
    fake.BatchPrefillWithPagedKVCacheWrapper = _StandInWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)

    def make_fi():
        return FlashInferAttentionBackend(8, 2, 16, workspace_bytes=1024)

    ref, got = run_both(make_fi, torch.float32, torch.device("cpu"), reqs, block_size=4, head_dim=16)
    # NOTE: fp32 torch backend vs the float64 stand-in: |out| < 3, a few ulps (1.2e-7 relative) through
    # the D = 16 dot products, exp and softmax sums, ~1e-6; 1e-5 + 1e-5 |x| leaves ~10x
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_torch_backend_on_cuda(dtype):
    pytest.importorskip("flashinfer")
    device = torch.device("cuda")
    fi = select_backend(8, 2, 128, dtype=dtype, device=device)  # auto-selection must pick flashinfer
    assert fi.kind is AttentionBackendKind.FLASHINFER
    ref, got = run_both(lambda: fi, dtype, device)
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
