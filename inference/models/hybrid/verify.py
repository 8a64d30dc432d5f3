"""Speculative verify steps through the Mamba2 layers, and the state rollback after them.

A verify step feeds request `b` its last token and its proposed tokens (`lens[b]` rows from
`starts[b]`), each to be computed as the one-token decode it stands for. Attention gets that from
its mask; a recurrent layer has to run the rows in order. So `verify_layer` runs position `j` of
every request as one batched decode step, with the decode path's own functions (`conv_decode`,
`ssm_step`, no `dt` clamp) on working copies of the state, and leaves the pool rows as they were:
after sampling only a prefix of each request's rows is kept, and its state must then be the one
after exactly that prefix.

Rollback by replay, not by snapshots. Snapshotting the state after every position would cost an
SSM state per Mamba layer per verified token (Bamba-9B: 4 MiB x 32 layers, ~130 MiB a token).
Instead the layer records, per row, the conv input and the SSM step's inputs (`xBC` before and
after the conv, `dt`: a few KiB per layer), and `advance_layer` replays the conv window shift and
`ssm_advance` over the kept rows onto the untouched pool rows. These are the same functions on the
same inputs as the verify's own steps (and as a plain decode of those tokens), so the state kept is
exact, not approximate; the cost is one more pass over the state per kept token and layer, and no
second forward.
"""

from __future__ import annotations

from typing import Optional

import torch

from inference.models.hybrid.mamba2 import (
    Mamba2Dims,
    Mamba2Weights,
    conv_decode,
    gate_norm,
    in_projection,
    split_xbc,
    ssm_advance,
    ssm_constants,
    ssm_step,
)
from inference.models.packed_weights import linear  # NOTE: F.linear, bf16 on CPU through a pack (same bits)


class MambaRecord:
    """What one Mamba layer of a verify step leaves for `advance_layer`, per flat-batch row: its
    conv input `xbc` and conv output `conv_out` (`[T, C]`, model dtype) and step sizes `dt` (`[T, H]`)."""

    __slots__ = ("layer", "xbc", "conv_out", "dt")

    def __init__(self, layer: int, xbc: torch.Tensor, conv_out: torch.Tensor, dt: torch.Tensor) -> None:
        self.layer, self.xbc, self.conv_out, self.dt = layer, xbc, conv_out, dt


def _starts(lens: list[int]) -> list[int]:
    out, total = [], 0
    for n in lens:
        out.append(total)
        total += n
    return out


def _columns(counts: list[int], starts: list[int],
             device: torch.device) -> list[tuple[Optional[torch.Tensor], torch.Tensor]]:
    """Per position `j < max(counts)`: (the requests `b` with `counts[b] > j`, None when all;
    their rows `starts[b] + j`)."""
    out = []
    for j in range(max(counts)):
        live = [b for b, n in enumerate(counts) if n > j]
        rows = torch.tensor([starts[b] + j for b in live], dtype=torch.int64, device=device)
        out.append((None if len(live) == len(counts) else torch.tensor(live, dtype=torch.int64, device=device), rows))
    return out


def verify_layer(hidden: torch.Tensor, w: Mamba2Weights, dims: Mamba2Dims, layer: int, conv_states: torch.Tensor,
                 ssm_states: torch.Tensor, slots: torch.Tensor, lens: list[int],
                 proj_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, MambaRecord]:
    """The Mamba2 mixer over a verify step's rows (`hidden [T, hidden]`, request `b` at state row
    `slots[b]` owning `lens[b]` rows); returns `([T, hidden], its record)`. Reads the state rows,
    never writes them."""
    dtype = hidden.dtype
    z, xbc, dt = in_projection(hidden, w, dims, proj_scale)
    A, D = ssm_constants(w)
    windows, states = conv_states.index_select(0, slots), ssm_states.index_select(0, slots).float()
    conv_out = torch.empty_like(xbc)
    y = torch.empty(hidden.shape[0], dims.num_heads, dims.head_dim, dtype=torch.float32, device=hidden.device)
    for live, rows in _columns(lens, _starts(lens), hidden.device):
        win = windows if live is None else windows.index_select(0, live)
        st = states if live is None else states.index_select(0, live)
        out_j, new_win = conv_decode(xbc.index_select(0, rows), win, w.conv_w, w.conv_b)
        x, B, C = split_xbc(out_j.float(), dims)
        y_j, st = ssm_step(x, dt.index_select(0, rows), A, B, C, D, st)  # NOTE: st updated in place
        if live is None:
            windows = new_win
        else:
            windows.index_copy_(0, live, new_win)
            states.index_copy_(0, live, st)
        y.index_copy_(0, rows, y_j)
        conv_out.index_copy_(0, rows, out_j)
    out = gate_norm(y.view(hidden.shape[0], dims.intermediate), z, w.norm_w, dims, dtype)
    return linear(out, w.out_w, w.out_b), MambaRecord(layer, xbc, conv_out, dt)


def advance_layer(record: MambaRecord, w: Mamba2Weights, dims: Mamba2Dims, conv_states: torch.Tensor,
                  ssm_states: torch.Tensor, slots: torch.Tensor, lens: list[int], kept: list[int]) -> None:
    """Move the state rows `slots[b]` over the first `kept[b]` (>= 1) of request `b`'s `lens[b]`
    verify rows: the conv window shift and `ssm_advance` of `conv_decode` / `ssm_step`, replayed."""
    if any(not 1 <= k <= n for k, n in zip(kept, lens, strict=True)):
        raise ValueError(f"advance_layer: kept {kept} must be within 1..lens {lens}")
    A, _ = ssm_constants(w)
    windows, states = conv_states.index_select(0, slots), ssm_states.index_select(0, slots).float()
    for live, rows in _columns(kept, _starts(lens), slots.device):
        x, B, _ = split_xbc(record.conv_out.index_select(0, rows).float(), dims)
        win = windows if live is None else windows.index_select(0, live)
        st = states if live is None else states.index_select(0, live)
        # NOTE: conv_decode's window update: drop the oldest input, append this row's
        new_win = torch.cat((win, record.xbc.index_select(0, rows).unsqueeze(2).to(win.dtype)), dim=2)[:, :, 1:]
        ssm_advance(x, record.dt.index_select(0, rows), A, B, st)
        if live is None:
            windows = new_win
        else:
            windows.index_copy_(0, live, new_win)
            states.index_copy_(0, live, st)
    conv_states.index_copy_(0, slots, windows.to(conv_states.dtype))
    ssm_states.index_copy_(0, slots, states.to(ssm_states.dtype))
