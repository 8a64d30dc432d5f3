"""flashinfer attention (GPU only), against its documented paged-KV wrappers.

flashinfer is imported when a backend is constructed, never at module import, so CPU installs
can import this module. The buffer's per-layer `[2, num_blocks, block_size, H, D]` view is
exactly the "NHD" paged layout: `(kv[0], kv[1])` is passed as the `(k_cache, v_cache)` tuple.

Per step, `plan` turns block tables into flashinfer's CSR page lists (`indptr`, `indices`,
`last_page_len`) and plans a decode wrapper for the one-row requests and a causal prefill wrapper
for the rest (flashinfer aligns the causal mask bottom-right, so a chunk sees all earlier KV of
its request); every layer then only runs the planned kernels.

NOTE: the real kernels need CUDA: `tests/inference/attention/test_flashinfer_attention.py`
compares them with the torch backend (marked `gpu`); on CPU the same file checks this module's
plan/run logic against a stand-in that implements the wrappers' documented semantics.
"""

from __future__ import annotations

import torch

from inference.attention.base import AttentionBackend, AttentionBackendKind
from inference.attention.metadata import AttentionMetadata, split_decode_prefill
from inference.cache.kv_buffer import KVCacheBuffer

_WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's recommended float workspace size


def _page_lists(tables: torch.Tensor, reqs: torch.Tensor, seq_lens_cpu: torch.Tensor, block_size: int):
    """CSR pages of `reqs`: indptr int32 `[n + 1]` (host), indices int32 (device), last_len (host).

    indptr / last_len stay on the host because `plan` reads them there anyway (as vLLM passes
    them); the page indices are gathered on the device, where the block tables live.
    """
    n_pages = (seq_lens_cpu.to(torch.int64) + block_size - 1) // block_size
    indptr = torch.zeros(n_pages.numel() + 1, dtype=torch.int32)
    indptr[1:] = n_pages.cumsum(0)
    last_len = (seq_lens_cpu.to(torch.int64) - (n_pages - 1) * block_size).to(torch.int32)
    rows = tables.index_select(0, reqs)[:, : int(n_pages.max())]
    used = torch.arange(rows.shape[1], device=rows.device)[None, :] < n_pages.to(rows.device)[:, None]
    indices = rows[used].to(torch.int32)  # row-major: request 0's pages, then request 1's, ...
    return indptr, indices, last_len


class FlashInferAttentionBackend(AttentionBackend):
    """Paged attention with flashinfer's batch decode / batch prefill wrappers (NHD layout)."""

    kind = AttentionBackendKind.FLASHINFER

    def __init__(self, *args, workspace_bytes: int = _WORKSPACE_BYTES, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # NOTE: the CUDA check lives in `select_backend`; constructed directly, the backend trusts
        # its caller, which lets tests drive it on CPU against a stand-in `flashinfer` module.
        import flashinfer  # lazy: GPU-only dependency

        # NOTE: one float workspace shared by both wrappers (they never run concurrently); zeroed
        # because some flashinfer kernels require a zero-initialised workspace on first use.
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self.group_size >= 4
        )
        self._prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._slot_mapping: torch.Tensor | None = None
        self._num_tokens = 0
        self._decode_tokens: torch.Tensor | None = None
        self._prefill_tokens: torch.Tensor | None = None
        self._has_decode = self._has_prefill = False

    def plan(self, meta: AttentionMetadata, kv_cache: KVCacheBuffer) -> None:
        split = split_decode_prefill(meta)
        bs = kv_cache.block_size
        tables = meta.block_tables
        heads = (self.num_heads, self.num_kv_heads, self.head_dim, bs)
        dtypes = dict(q_data_type=self.dtype, kv_data_type=kv_cache.dtype, sm_scale=self.scale)
        self._slot_mapping = meta.slot_mapping
        self._num_tokens = meta.num_tokens
        self._has_decode = split.decode_reqs is not None
        self._has_prefill = split.prefill_reqs is not None
        # a group that is the whole batch needs no gather/scatter of query rows
        self._decode_tokens = split.decode_tokens if self._has_prefill else None
        self._prefill_tokens = split.prefill_tokens if self._has_decode else None
        if self._has_decode:
            indptr, indices, last_len = _page_lists(tables, split.decode_reqs, split.decode_seq_lens_cpu, bs)
            self._decode_wrapper.plan(indptr, indices, last_len, *heads, **dtypes)
        if self._has_prefill:
            q_lens = split.prefill_query_lens_cpu
            qo_indptr = torch.zeros(q_lens.numel() + 1, dtype=torch.int32)
            qo_indptr[1:] = q_lens.cumsum(0)
            indptr, indices, last_len = _page_lists(tables, split.prefill_reqs, split.prefill_seq_lens_cpu, bs)
            self._prefill_wrapper.plan(qo_indptr, indptr, indices, last_len, *heads, causal=True, **dtypes)

    def forward(self, layer, q, k, v, kv_cache):
        if self._slot_mapping is None:
            raise RuntimeError("FlashInferAttentionBackend.forward called before plan()")
        kv_cache.store(layer, self._slot_mapping, k, v)
        kv = kv_cache.layer(layer)
        paged = (kv[0], kv[1])
        width = self.num_heads * self.head_dim
        if not self._has_prefill:
            return self._decode_wrapper.run(q.contiguous(), paged).reshape(-1, width)
        if not self._has_decode:
            return self._prefill_wrapper.run(q.contiguous(), paged).reshape(-1, width)
        out = q.new_empty(self._num_tokens, width)
        dec = self._decode_wrapper.run(q.index_select(0, self._decode_tokens), paged)
        out.index_copy_(0, self._decode_tokens, dec.reshape(-1, width))
        pf = self._prefill_wrapper.run(q.index_select(0, self._prefill_tokens), paged)
        out.index_copy_(0, self._prefill_tokens, pf.reshape(-1, width))
        return out
