"""One step's LoRA work: the rows of each adapter present, and the grouped update of a projection.

The flat batch mixes requests of several adapters and of the base model. Once per step the rows
with an adapter are ordered by adapter (`LoRAGroups`: a permutation and one contiguous segment per
adapter). An input group of projections (q/k/v, o, gate/up, down) then costs one gather of its
input in that order, per adapter one GEMM against its stacked A and one small GEMM per B written
into its segment of a delta buffer, and one scatter-add per projection: the number of requests
never enters. A step where one adapter has every row skips the gather and scatter. Past the last
attention the decoder keeps only the sampled rows; `sampled` is the same grouping over those.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from inference.lora.adapter import LoRAAdapter

MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # `F.linear(x, weight)`'s maths


class LoRAGroups:
    """Rows with an adapter, ordered by adapter: `perm` (None: every row, in order, one adapter)
    and `segments` `(adapter, start, end)` over that order."""

    __slots__ = ("perm", "product", "rows", "segments")

    def __init__(self, ids: np.ndarray, adapter_of: Callable[[int], LoRAAdapter], device: torch.device,
                 product: Product | None = None) -> None:
        # NOTE: a batch-invariant forward's fixed-order `linear` (its caller's), so that a row's bits do not
        # depend on how many rows its adapter's segment holds; None: torch's products
        self.product = product
        rows = np.flatnonzero(ids >= 0)
        order = rows[np.argsort(ids[rows], kind="stable")]
        sorted_ids = ids[order]
        cuts = np.flatnonzero(np.diff(sorted_ids)) + 1
        starts, ends = np.r_[0, cuts], np.r_[cuts, order.size]
        self.segments = [(adapter_of(int(sorted_ids[s])), int(s), int(e)) for s, e in zip(starts, ends)] \
            if order.size else []
        self.rows = int(order.size)
        whole = order.size == ids.size and len(self.segments) == 1
        self.perm = None if whole else torch.from_numpy(order).to(device, non_blocking=True)

    def add(self, x: torch.Tensor, layer: int, group: str, outs: tuple[torch.Tensor, ...]) -> None:
        """Add each adapter's update of the projections of input group `group` (outputs `outs`,
        in `INPUT_GROUPS` order, written in place) computed from their input `x`."""
        xs = x if self.perm is None else x.index_select(0, self.perm)
        deltas: list[torch.Tensor | None] = [None] * len(outs)
        product = self.product
        for adapter, start, end in self.segments:
            for a, scale, parts in adapter.fused[layer].get(group, ()):
                u = F.linear(xs[start:end], a) if product is None else product(xs[start:end], a)
                if scale != 1.0:  # NOTE: a shared adapter's scaling: B is the trainer's, nothing folded into it
                    u.mul_(scale)
                for j, r0, r1, b, bt in parts:
                    if deltas[j] is None:  # NOTE: zeros: another adapter of the step may not adapt this one
                        deltas[j] = xs.new_zeros(self.rows, outs[j].shape[1])
                    if product is None:
                        torch.mm(u[:, r0:r1], bt, out=deltas[j][start:end])
                    else:  # NOTE: B itself, a stable tensor: bf16 packs it once (again when it is written)
                        if b.dtype == torch.float32 and not b.is_contiguous():  # NOTE: the fp32 kernel's layout
                            b = b.contiguous()
                        deltas[j][start:end] = product(u[:, r0:r1], b)
        for y, d in zip(outs, deltas):
            if d is None:
                continue
            if self.perm is None:
                y += d
            else:
                y.index_add_(0, self.perm, d)

    def adapts(self, layer: int, projs: tuple[str, ...]) -> bool:
        return any(adapter.adapts(layer, projs) for adapter, _, _ in self.segments)


class LoRABatch:
    """The step's grouping of all rows (`tokens`) and of the sampled rows (`sampled`, built on
    first use). `token_ids[t]` is the resident id of row t's adapter, -1 for the base model."""

    __slots__ = ("_adapter_of", "_device", "_ids", "_product", "_rows", "_sampled", "tokens")

    def __init__(self, token_ids: np.ndarray, logits_rows: np.ndarray,
                 adapter_of: Callable[[int], LoRAAdapter], device: torch.device,
                 product: Product | None = None) -> None:
        self._ids, self._rows, self._adapter_of, self._device = token_ids, logits_rows, adapter_of, device
        self._product = product
        self.tokens = LoRAGroups(token_ids, adapter_of, device, product)
        self._sampled: LoRAGroups | None = None

    @property
    def sampled(self) -> LoRAGroups:
        if self._sampled is None:
            self._sampled = LoRAGroups(self._ids[self._rows], self._adapter_of, self._device, self._product)
        return self._sampled
