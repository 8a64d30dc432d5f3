"""One step's LoRA work: the rows of each adapter present, and the grouped update of a projection.

The flat batch mixes requests of several adapters and of the base model. Rows are grouped by
adapter once per step (`LoRABatch`), so each adapted projection costs one small GEMM pair per
adapter in the step: `y[rows] += (x[rows] A^T) B^T`, whatever the number of requests. A group
covering every row skips the gather and scatter. Past the last attention the decoder keeps only
the sampled rows; `sampled` is the same grouping over those.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from inference.lora.adapter import LoRAAdapter

MLP_PROJS = ("gate_proj", "up_proj", "down_proj")


class LoRAGroups:
    """`(adapter, rows)` per adapter present in a set of rows; `rows` None means all of them."""

    __slots__ = ("groups",)

    def __init__(self, ids: np.ndarray, adapter_of: Callable[[int], LoRAAdapter], device: torch.device) -> None:
        present = np.unique(ids[ids >= 0])
        self.groups: list[tuple[LoRAAdapter, torch.Tensor | None]] = []
        for a in present.tolist():
            rows = np.flatnonzero(ids == a)
            idx = None if rows.size == ids.size else torch.from_numpy(rows).to(device, non_blocking=True)
            self.groups.append((adapter_of(a), idx))

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, proj: str) -> torch.Tensor:
        """`y` (the base projection of `x`, written in place) plus each group's LoRA update."""
        for adapter, idx in self.groups:
            ab = adapter.layers[layer].get(proj)
            if ab is None:
                continue
            a, b = ab
            if idx is None:
                y += F.linear(F.linear(x, a), b)
            else:
                y.index_add_(0, idx, F.linear(F.linear(x.index_select(0, idx), a), b))
        return y

    def adapts(self, layer: int, projs: tuple[str, ...]) -> bool:
        return any(adapter.adapts(layer, projs) for adapter, _ in self.groups)


class LoRABatch:
    """The step's grouping of all rows (`tokens`) and of the sampled rows (`sampled`, built on
    first use). `token_ids[t]` is the resident id of row t's adapter, -1 for the base model."""

    __slots__ = ("_adapter_of", "_device", "_ids", "_rows", "_sampled", "tokens")

    def __init__(self, token_ids: np.ndarray, logits_rows: np.ndarray,
                 adapter_of: Callable[[int], LoRAAdapter], device: torch.device) -> None:
        self._ids, self._rows, self._adapter_of, self._device = token_ids, logits_rows, adapter_of, device
        self.tokens = LoRAGroups(token_ids, adapter_of, device)
        self._sampled: LoRAGroups | None = None

    @property
    def sampled(self) -> LoRAGroups:
        if self._sampled is None:
            self._sampled = LoRAGroups(self._ids[self._rows], self._adapter_of, self._device)
        return self._sampled
