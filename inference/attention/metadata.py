"""What one step's flat token batch looks like to attention (see docs/INTERFACES.md).

A step holds `T` tokens of `B` requests; each request's tokens are contiguous and the requests are
in order. Request `r` owns query rows `query_start_loc[r]:query_start_loc[r + 1]` and, after this
step's K/V are appended, `seq_lens[r]` KV entries, the last `q_len` of which are this step's. So a
query at row `i` of its request sits at KV position `seq_lens[r] - q_len + i` and sees every KV
position up to and including that one (causal across chunk boundaries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs; built once per step, shared by every layer.

    `query_start_loc` int32 `[B + 1]`, `seq_lens` int32 `[B]`, `block_tables` int32
    `[B, max_blocks]` (entries past a request's blocks are padding: any value, they are never
    read unmasked), `slot_mapping` int64 `[T]`. `max_query_len` / `max_seq_len` are python ints so
    that backends can size buffers without a device sync. `query_start_loc_cpu` / `seq_lens_cpu`,
    when given, are host copies of the same values, so that planning needs no device-to-host copy.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # NOTE: only metadata (dtype / rank / sizes) is checked: no device sync on the hot path.
        checks = (
            ("query_start_loc", self.query_start_loc, torch.int32, 1),
            ("seq_lens", self.seq_lens, torch.int32, 1),
            ("block_tables", self.block_tables, torch.int32, 2),
            ("slot_mapping", self.slot_mapping, torch.int64, 1),
        )
        for name, t, dtype, ndim in checks:
            if t.dtype != dtype or t.dim() != ndim:
                raise ValueError(
                    f"AttentionMetadata.{name} must be a {ndim}-D {dtype} tensor, got {t.dim()}-D {t.dtype}"
                )
        b = self.seq_lens.shape[0]
        if self.query_start_loc.shape[0] != b + 1:
            raise ValueError(
                f"AttentionMetadata.query_start_loc has {self.query_start_loc.shape[0]} entries, "
                f"expected num_requests + 1 = {b + 1}"
            )
        if self.block_tables.shape[0] != b:
            raise ValueError(f"AttentionMetadata.block_tables has {self.block_tables.shape[0]} rows, expected {b}")

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        pad_block_id: int = 0,
    ) -> AttentionMetadata:
        """Build from python lists (tests, examples; not the engine's hot path).

        `block_tables[r]` lists request `r`'s blocks in order; it must cover `seq_lens[r]` tokens.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per request")
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if not 0 < q_len <= s_len:
                raise ValueError(f"need 0 < query_len <= seq_len, got {q_len} and {s_len}")
            if len(table) * block_size < s_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {s_len} tokens")
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [list(t) + [pad_block_id] * (width - len(t)) for t in block_tables]
        qsl = [0]
        for q_len in query_lens:
            qsl.append(qsl[-1] + q_len)
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), width),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )


@dataclass(slots=True)
class BatchSplit:
    """A step's requests split into decode (one query row) and prefill (more) groups.

    A request with exactly one query row is a decode row whatever its history (a prefill chunk of
    one token attends exactly like a decode token). `*_reqs` are request indices and `*_tokens`
    rows of the flat batch, int64 on the step's device, None when the group is empty. The
    `*_cpu` tensors are host copies of the groups' lengths, so that sizes are known without a
    device sync.
    """

    decode_reqs: torch.Tensor | None
    decode_tokens: torch.Tensor | None
    prefill_reqs: torch.Tensor | None
    prefill_tokens: torch.Tensor | None
    decode_seq_lens_cpu: torch.Tensor
    prefill_query_lens_cpu: torch.Tensor
    prefill_seq_lens_cpu: torch.Tensor

    @property
    def decode_only(self) -> bool:
        return self.prefill_reqs is None

    @property
    def prefill_only(self) -> bool:
        return self.decode_reqs is None


def split_decode_prefill(meta: AttentionMetadata) -> BatchSplit:
    """Split the step into its decode and prefill requests (a few host ops, once per step)."""
    device = meta.query_start_loc.device
    qsl = (meta.query_start_loc if meta.query_start_loc_cpu is None else meta.query_start_loc_cpu).cpu()
    qsl = qsl.to(torch.int64)
    seq_lens = (meta.seq_lens if meta.seq_lens_cpu is None else meta.seq_lens_cpu).cpu()
    q_lens = qsl[1:] - qsl[:-1]
    is_dec = q_lens == 1
    dec_reqs = is_dec.nonzero().flatten()
    pf_reqs = (~is_dec).nonzero().flatten()
    pf_lens = q_lens[pf_reqs]
    # rows of prefill request r: start[r] + 0..len[r]-1, built without a python loop
    offsets = torch.arange(int(pf_lens.sum())) - torch.repeat_interleave(pf_lens.cumsum(0) - pf_lens, pf_lens)
    pf_toks = torch.repeat_interleave(qsl[:-1][pf_reqs], pf_lens) + offsets
    dec_toks = qsl[:-1][dec_reqs]

    def on_device(t: torch.Tensor) -> torch.Tensor | None:
        return t.to(device, non_blocking=True) if t.numel() else None

    return BatchSplit(
        decode_reqs=on_device(dec_reqs),
        decode_tokens=on_device(dec_toks),
        prefill_reqs=on_device(pf_reqs),
        prefill_tokens=on_device(pf_toks),
        decode_seq_lens_cpu=seq_lens[dec_reqs],
        prefill_query_lens_cpu=pf_lens,
        prefill_seq_lens_cpu=seq_lens[pf_reqs],
    )
