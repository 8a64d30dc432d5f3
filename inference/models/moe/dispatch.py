"""Local dispatch: every expert lives in this process, so an MoE layer's (token, expert) pairs are
sorted by expert and each expert runs once over its rows (no collective). The same two paths as
the expert-parallel exchange (`models/parallel/expert_parallel.py`): variable (`ExpertWeights.sparse`,
host sync on the counts) and static (`ExpertWeights.masked`, for CUDA-graph capture)."""

from __future__ import annotations

import torch

from inference.models.moe.layer import ExpertWeights


class LocalDispatch:
    """All experts live in this process: sort the pairs by expert and run each expert once."""

    world_size = 1
    rank = 0

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.num_local = num_experts
        self.first_expert = 0

    def run(self, h: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights, *, static: bool = False) -> torch.Tensor:
        """Expert outputs `[T * k, H]` of every (token, choice) pair, in (token, choice) order."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        if static:
            return experts.masked(h.repeat_interleave(k, dim=0), flat)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.empty(flat.numel(), h.shape[1], dtype=h.dtype, device=h.device)
        out[order] = experts.sparse(h.index_select(0, order // k), counts)
        return out
