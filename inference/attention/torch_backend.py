"""Reference attention backend in plain torch (CPU and GPU).

Two groups per step, each one SDPA call per layer (CPU prefill aside, below):

* decode (requests with one query row): on CPU, the native kernel (`cpu_kernels.paged_decode`)
  attends straight from the pages, with no gather and no padding to the longest request.
  Otherwise (and as the reference) one `index_select` gathers every decode request's blocks
  from the paged buffer into `[Bd, S, Hkv, D]`; the G query heads that share a KV head are folded
  into SDPA's query-length axis (`[Bd, Hkv, G, D]`), so GQA needs no K/V repeat; a key-padding
  mask hides positions past each request's `seq_len`.
* prefill (more than one query row): query rows are scattered into a padded `[Bp, Lq]` grid
  (skipped for a single request), the KV of each request gathered the same way, and the mask
  `key_pos <= context_len + row` makes a chunk attend to all earlier KV of its request plus
  itself causally. Padding rows always see key 0, so no softmax row is empty (no NaN).
  On CPU with the native kernel, every query row of a prefill (or a verify step) is attended as a
  decode row of its own instead: its request's blocks (its K/V stored before attention, as always),
  as its length the tokens up to and including itself, so causality needs no mask and a row's
  output is the same bits as the same token's in a decode step. SDPA's CPU kernels spent ~230 us a
  call on an 80-token prompt's causal attention (SmolLM2's heads, bf16, 2 threads, Zen 4), ~16
  GFLOP/s, and a 2048-token prefill step of such prompts 17% of its time there.
  Without the kernel, up to `EACH_PREFILL_MAX` prefill requests take one SDPA call each, over their own
  rows only: a prompt from its first token attends causally to the step's own K/V (no gather, no
  mask: SDPA's causal kernel skips the masked half), a later chunk to its gathered blocks under
  its own `[Lq, S]` mask. The padded grid computes every request to the longest one's size, all
  of it for the masked half too: SmolLM2, 8 prompts of 37-248 tokens, one thread, one layer
  36 ms padded against 10 ms one call each.

Masks and gather indices are built once per step in `plan` and reused by every layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from inference.attention import cpu_kernels
from inference.attention.base import AttentionBackend, AttentionBackendKind
from inference.attention.metadata import AttentionMetadata, BatchSplit, split_decode_prefill
from inference.cache.kv_buffer import KVCacheBuffer

# prefill requests in a step up to which each takes its own SDPA call on CPU (module docstring);
# past it the per-call cost of the python loop outgrows what the padded grid wastes
EACH_PREFILL_MAX = 32


class _Chunk:
    """One prefill request's rows of the step: `start` and `length` among the prefill rows, its
    blocks, and its `[Lq, S]` mask when it attends to K/V before this chunk (None: it starts its
    prompt, so plain causal attention is its mask)."""

    __slots__ = ("start", "length", "seq_len", "block_ids", "mask")

    def __init__(self, start, length, seq_len, block_ids=None, mask=None):
        self.start, self.length, self.seq_len = start, length, seq_len
        self.block_ids, self.mask = block_ids, mask


class _Group:
    """One group's per-step tensors. `tokens` None means the group is the whole batch."""

    __slots__ = ("tokens", "block_ids", "mask", "batch", "kv_len", "q_len", "scatter", "tables", "seq_lens", "chunks")

    def __init__(self, tokens, block_ids, mask, batch, kv_len, q_len=1, scatter=None, tables=None, seq_lens=None,
                 chunks=None):
        self.tokens = tokens
        self.block_ids = block_ids
        self.mask = mask
        self.batch = batch
        self.kv_len = kv_len
        self.q_len = q_len
        self.scatter = scatter  # prefill: padded-grid row of each of the group's tokens
        self.tables = tables  # decode with the native kernel: int32 block tables and seq_lens
        self.seq_lens = seq_lens
        self.chunks = chunks  # prefill one request at a time: each one's `_Chunk`


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with `torch.nn.functional.scaled_dot_product_attention`."""

    kind = AttentionBackendKind.TORCH

    def __init__(self, *args, native_decode: bool | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        supported = cpu_kernels.supports(self.dtype, self.device, self.num_heads, self.head_dim)
        self.native_decode = supported if native_decode is None else (native_decode and supported)
        self._slot_mapping: torch.Tensor | None = None
        self._num_tokens = 0
        self._decode: _Group | None = None
        self._prefill: _Group | None = None
        # NOTE: one gather buffer per group, reused by every layer and step: a fresh KV-sized
        # buffer per layer costs page faults on CPU (45 ms vs 8 ms for a 71 MB gather measured)
        self._gather_buffers: dict[str, torch.Tensor] = {}

    def release_workspace(self) -> int:
        """Drop the reusable gather buffers (suspend hands their memory back too)."""
        freed = sum(b.numel() * b.element_size() for b in self._gather_buffers.values())
        self._gather_buffers.clear()
        return freed

    # -- per step --------------------------------------------------------------------------------

    def plan(self, meta: AttentionMetadata, kv_cache: KVCacheBuffer) -> None:
        split = split_decode_prefill(meta)
        self._slot_mapping = meta.slot_mapping
        self._num_tokens = meta.num_tokens
        if self.native_decode and split.prefill_reqs is not None and self._rows_are_tokens(meta):
            self._decode, self._prefill = self._plan_rows(meta), None
            return
        bs = kv_cache.block_size
        # NOTE: padded block-table entries may hold any value; clamping makes them valid block ids
        # whose (finite, see KVCacheBuffer) contents the masks then hide.
        tables = meta.block_tables.clamp(0, kv_cache.num_blocks - 1)
        self._decode = self._plan_decode(split, meta, tables, bs) if split.decode_reqs is not None else None
        self._prefill = self._plan_prefill(split, meta, tables, bs) if split.prefill_reqs is not None else None

    def native_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The planned step's `(slot_mapping, block_tables, seq_lens)` where the native kernel attends
        every query row in order (a decode step, or on the CPU any step whose rows are its tokens:
        `_plan_rows`), else None: what a caller running the blocks natively needs
        (`models/dense/native_layers.py`)."""
        dec = self._decode
        if self._prefill is not None or dec is None or dec.tables is None or dec.tokens is not None:
            return None
        if dec.batch != self._num_tokens or self._slot_mapping is None:
            return None
        return self._slot_mapping, dec.tables, dec.seq_lens

    @staticmethod
    def _rows_are_tokens(meta: AttentionMetadata) -> bool:
        qsl = meta.query_start_loc if meta.query_start_loc_cpu is None else meta.query_start_loc_cpu
        return int(qsl[-1]) == meta.num_tokens  # NOTE: no padding rows past the requests' own

    def _plan_rows(self, meta: AttentionMetadata) -> _Group:
        """Every query row of the step as a decode row of its own, for the native kernel (module
        docstring): its request's blocks, and as its length the tokens up to and including itself."""
        qsl = meta.query_start_loc.to(torch.int64)
        q_lens = qsl[1:] - qsl[:-1]
        req = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=qsl.device), q_lens)
        # NOTE: a row `back` tokens before its request's last query row attends `back` fewer tokens
        back = qsl[1:].index_select(0, req) - 1 - torch.arange(req.shape[0], device=qsl.device)
        seq_lens = (meta.seq_lens.index_select(0, req) - back).to(torch.int32)
        tables = meta.block_tables.index_select(0, req)
        return _Group(None, None, None, req.shape[0], 0, tables=tables, seq_lens=seq_lens)

    def _gather_ids(self, tables: torch.Tensor, reqs: torch.Tensor | None, kv_len: int, bs: int):
        n_blocks = -(-kv_len // bs)
        rows = tables if reqs is None else tables.index_select(0, reqs)
        return rows[:, :n_blocks].reshape(-1).to(torch.int64), n_blocks * bs

    def _plan_decode(self, split: BatchSplit, meta: AttentionMetadata, tables, bs: int) -> _Group:
        whole = split.decode_only
        reqs = None if whole else split.decode_reqs
        if self.native_decode:
            rows = meta.block_tables if whole else meta.block_tables.index_select(0, reqs)
            seq_lens = meta.seq_lens if whole else meta.seq_lens.index_select(0, reqs)
            return _Group(None if whole else split.decode_tokens, None, None, seq_lens.shape[0], 0,
                          tables=rows if rows.stride(1) == 1 else rows.contiguous(), seq_lens=seq_lens.contiguous())
        block_ids, kv_len = self._gather_ids(tables, reqs, int(split.decode_seq_lens_cpu.max()), bs)
        seq_lens = meta.seq_lens if whole else meta.seq_lens.index_select(0, reqs)
        keep = torch.arange(kv_len, device=seq_lens.device)[None, :] < seq_lens[:, None]
        mask = self._additive(keep)[:, None, None, :]  # [Bd, 1, 1, S]
        return _Group(None if whole else split.decode_tokens, block_ids, mask, seq_lens.shape[0], kv_len)

    def _plan_prefill(self, split: BatchSplit, meta: AttentionMetadata, tables, bs: int) -> _Group:
        whole = split.prefill_only
        reqs = None if whole else split.prefill_reqs
        q_lens_cpu, seq_lens_cpu = split.prefill_query_lens_cpu, split.prefill_seq_lens_cpu
        q_len, batch = int(q_lens_cpu.max()), q_lens_cpu.shape[0]
        if self.device.type == "cpu" and batch <= EACH_PREFILL_MAX:
            return self._plan_prefill_each(split, tables, bs)
        block_ids, kv_len = self._gather_ids(tables, reqs, int(seq_lens_cpu.max()), bs)
        device = meta.seq_lens.device
        ctx = (seq_lens_cpu - q_lens_cpu).to(device, torch.int64)
        scatter = None  # a single request needs no padded grid: its rows already are one
        if batch > 1:
            # padded-grid row of every prefill token: request_index * q_len + row_within_request
            q_lens = q_lens_cpu.to(device, torch.int64)
            req_of_tok = torch.repeat_interleave(torch.arange(batch, device=device), q_lens)
            first_tok = torch.repeat_interleave(q_lens.cumsum(0) - q_lens, q_lens)
            scatter = req_of_tok * q_len + (torch.arange(int(q_lens_cpu.sum()), device=device) - first_tok)
        rows = torch.arange(q_len, device=device)
        keys = torch.arange(kv_len, device=device)
        keep = keys[None, None, :] <= (ctx[:, None, None] + rows[None, :, None])  # [Bp, Lq, S]
        mask = self._additive(keep)[:, None]  # [Bp, 1, Lq, S], broadcast over heads
        tokens = None if whole else split.prefill_tokens
        return _Group(tokens, block_ids, mask, batch, kv_len, q_len, scatter)

    def _plan_prefill_each(self, split: BatchSplit, tables, bs: int) -> _Group:
        """Each prefill request's rows, and for a later chunk its blocks and mask (module docstring)."""
        rows = tables if split.prefill_only else tables.index_select(0, split.prefill_reqs)
        chunks, start = [], 0
        for i, (length, seq_len) in enumerate(zip(split.prefill_query_lens_cpu.tolist(),
                                                  split.prefill_seq_lens_cpu.tolist())):
            chunk = _Chunk(start, length, seq_len, rows[i, : -(-seq_len // bs)].to(torch.int64))
            context = seq_len - length
            if context:
                keys = torch.arange(seq_len, device=rows.device)
                queries = torch.arange(context, seq_len, device=rows.device)
                chunk.mask = self._additive(keys[None, :] <= queries[:, None])  # [Lq, S]
            chunks.append(chunk)
            start += length
        tokens = None if split.prefill_only else split.prefill_tokens
        return _Group(tokens, None, None, len(chunks), 0, chunks=chunks)

    def _additive(self, keep: torch.Tensor) -> torch.Tensor:
        # NOTE: an additive mask in the query dtype is measurably faster than a bool one on CPU SDPA
        zero = torch.zeros((), dtype=self.dtype, device=keep.device)
        return torch.where(keep, zero, torch.tensor(float("-inf"), dtype=self.dtype, device=keep.device))

    # -- per layer -------------------------------------------------------------------------------

    def forward(self, layer, q, k, v, kv_cache):
        if self._slot_mapping is None:
            raise RuntimeError("TorchAttentionBackend.forward called before plan()")
        kv_cache.store(layer, self._slot_mapping, k, v)
        kv = kv_cache.layer(layer)
        dec, pf = self._decode, self._prefill
        if pf is None:
            return self._attend_decode(q, kv, dec)
        if dec is None:
            return self._attend_prefill(q, kv, pf) if pf.chunks is None else self._attend_each(q, k, v, kv, pf)
        out = q.new_empty(self._num_tokens, self.num_heads * self.head_dim)
        out.index_copy_(0, dec.tokens, self._attend_decode(q.index_select(0, dec.tokens), kv, dec))
        q = q.index_select(0, pf.tokens)
        if pf.chunks is None:
            out.index_copy_(0, pf.tokens, self._attend_prefill(q, kv, pf))
        else:
            k, v = k.index_select(0, pf.tokens), v.index_select(0, pf.tokens)
            out.index_copy_(0, pf.tokens, self._attend_each(q, k, v, kv, pf))
        return out

    def _native_out(self, batch: int, dtype: torch.dtype) -> torch.Tensor:
        """A `[batch, Hq, D]` view of a reusable buffer for the native kernel's output: bf16 for bf16
        queries (the kernel rounds it), else float32. NOTE: the layer's output projection reads it
        before the next layer's attention writes it again."""
        size = batch * self.num_heads * self.head_dim
        dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        buf = self._gather_buffers.get("native_out")
        if buf is None or buf.numel() < size or buf.dtype != dtype:
            buf = self._gather_buffers["native_out"] = torch.empty(size + size // 4, dtype=dtype)
        return buf[:size].view(batch, self.num_heads, self.head_dim)

    def _gather_kv(self, kv: torch.Tensor, g: _Group, group: str):
        # one gather for K and V of all the group's blocks: [2, B * n_blocks, bs, Hkv, D]
        shape = (2, g.block_ids.numel(), *kv.shape[2:])
        size = math.prod(shape)
        buf = self._gather_buffers.get(group)
        if buf is None or buf.numel() < size or buf.dtype != kv.dtype or buf.device != kv.device:
            buf = torch.empty(size + size // 4, dtype=kv.dtype, device=kv.device)  # headroom: grows rarely
            self._gather_buffers[group] = buf
        blocks = torch.index_select(kv, 1, g.block_ids, out=buf[:size].view(shape))
        blocks = blocks.view(2, g.batch, g.kv_len, self.num_kv_heads, self.head_dim).transpose(2, 3)
        return blocks[0], blocks[1]  # [B, Hkv, S, D] each

    def _attend_decode(self, q: torch.Tensor, kv: torch.Tensor, g: _Group) -> torch.Tensor:
        if g.tables is not None:
            out = self._native_out(g.batch, q.dtype)
            rows = q.reshape(g.batch, self.num_heads, self.head_dim)  # NOTE: a view of q's rows where it can be
            if rows.stride(2) != 1 or rows.stride(1) != self.head_dim:
                rows = rows.contiguous()
            cpu_kernels.paged_decode(rows, kv[0], kv[1], g.tables, g.seq_lens, self.scale, out)
            return out.view(g.batch, self.num_heads * self.head_dim)  # NOTE: q's dtype (the kernels' two)
        k, v = self._gather_kv(kv, g, "decode")
        q = q.view(g.batch, self.num_kv_heads, self.group_size, self.head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=self.scale)
        return o.reshape(g.batch, self.num_heads * self.head_dim)

    def _attend_each(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                     g: _Group) -> torch.Tensor:
        """Prefill one request at a time (`_plan_prefill_each`): `q`, `k`, `v` are the prefill rows."""
        width = self.num_heads * self.head_dim
        out = q.new_empty(q.shape[0], width)
        fresh = k.dtype == kv.dtype  # NOTE: else the cache holds K/V rounded to its dtype: read those
        for c in g.chunks:
            rows = slice(c.start, c.start + c.length)
            qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
            if c.mask is None and fresh:
                kc, vc = (t[rows].transpose(0, 1).unsqueeze(0) for t in (k, v))
                o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                pages = kv.index_select(1, c.block_ids).flatten(1, 2)[:, : c.seq_len].transpose(1, 2)  # [2, Hkv, S, D]
                o = F.scaled_dot_product_attention(qc, pages[0:1], pages[1:2], attn_mask=c.mask,
                                                   is_causal=c.mask is None, scale=self.scale, enable_gqa=True)
            out[rows] = o[0].transpose(0, 1).reshape(c.length, width)
        return out

    def _attend_prefill(self, q: torch.Tensor, kv: torch.Tensor, g: _Group) -> torch.Tensor:
        k, v = self._gather_kv(kv, g, "prefill")
        lq, width = g.q_len, self.num_heads * self.head_dim
        grid = q
        if g.scatter is not None:
            grid = q.new_zeros(g.batch * lq, self.num_heads, self.head_dim)
            grid.index_copy_(0, g.scatter, q)
        grid = grid.view(g.batch, lq, self.num_heads, self.head_dim).transpose(1, 2)  # [Bp, Hq, Lq, D]
        # NOTE: unlike decode, prefill uses enable_gqa: as fast here, and the mask is not repeated G times
        o = F.scaled_dot_product_attention(grid, k, v, attn_mask=g.mask, scale=self.scale, enable_gqa=True)
        o = o.transpose(1, 2).reshape(g.batch * lq, width)
        return o if g.scatter is None else o.index_select(0, g.scatter)
