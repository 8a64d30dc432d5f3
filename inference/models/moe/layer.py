"""The maths of a sparse MoE block: a top-k router and SwiGLU experts, as functions over tensors.

Op order and dtypes follow HF transformers (Qwen2-MoE, Qwen3-MoE, Mixtral): router logits in the
model dtype; softmax (or sigmoid) in fp32; top-k; optional renormalisation; routing weights cast
back to the model dtype (Qwen) or kept in fp32 (Mixtral). Each expert is
`down(silu(gate(x)) * up(x))` with gate and up fused as `gate_up_proj [E, 2I, H]` (gate rows
first, HF's layout). A token's weighted expert outputs are summed in ascending expert order in
the model dtype, which is what HF's `index_add_` loop over experts amounts to, so bf16 rounds alike.

Experts run per expert over the rows routed to it: `ExpertWeights.sparse` (one matmul pair per
expert hit; row counts read on the host) or, where no host sync is allowed (CUDA-graph capture),
`ExpertWeights.masked` (every expert over every row, each row keeping its own expert's output).
Where the rows go (this process or other expert-parallel ranks) is the dispatcher's business
(`inference/models/parallel/expert_parallel.py`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from inference.models.layers import swiglu


class Scoring(str, enum.Enum):
    """How router logits become expert scores: softmax over experts, or an independent sigmoid."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """A top-k router. `normalize`: the k weights are divided by their sum. `fp32_weights`: the
    weights stay fp32 until each expert's contribution is cast (Mixtral); else they are cast to
    the model dtype at once (Qwen)."""

    num_experts: int
    top_k: int
    scoring: Scoring = Scoring.SOFTMAX
    normalize: bool = False
    fp32_weights: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"RouterSpec.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")


def router_scores(logits: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """fp32 scores `[T, E]` of the router's logits."""
    if spec.scoring is Scoring.SOFTMAX:
        return torch.softmax(logits, dim=-1, dtype=torch.float32)
    return torch.sigmoid(logits.float())


def weights_for(scores: torch.Tensor, ids: torch.Tensor, spec: RouterSpec, dtype: torch.dtype) -> torch.Tensor:
    """The routing weights `[T, k]` of the chosen `ids` given fp32 `scores` (chosen by the router
    itself, or replayed from elsewhere)."""
    weights = scores.gather(-1, ids)
    if spec.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights if spec.fp32_weights else weights.to(dtype)


def route(h: torch.Tensor, gate_w: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids `[T, k]` int64, routing weights `[T, k]`) for hidden rows `h [T, H]`."""
    logits = F.linear(h, gate_w)
    scores = router_scores(logits, spec)
    top, ids = torch.topk(scores, spec.top_k, dim=-1)
    if spec.normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return ids, top if spec.fp32_weights else top.to(logits.dtype)


@dataclass(slots=True)
class ExpertWeights:
    """One layer's local experts: `gate_up [E_local, 2I, H]`, `down [E_local, H, I]`."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def num_local(self) -> int:
        return self.gate_up.shape[0]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[e])

    def sparse(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`rows` sorted by local expert, `counts[e]` of them for expert e: each expert's output
        over its own rows (experts without rows cost nothing)."""
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start : start + n] = self.expert(e, rows[start : start + n])
                start += n
        return out

    def masked(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Capture-safe (no host sync): every expert over every row; row i keeps expert
        `local_ids[i]`'s output, or zero where `local_ids[i] < 0` (an empty slot)."""
        out = torch.zeros_like(rows)
        for e in range(self.num_local):
            out = torch.where((local_ids == e)[:, None], self.expert(e, rows), out)
        return out


def combine(contrib: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum each token's weighted expert outputs. `contrib [T * k, H]` holds the expert outputs in
    (token, choice) order; the sum runs in ascending expert order, in `dtype`, like HF's."""
    t, k = ids.shape
    weighted = (contrib.view(t, k, contrib.shape[-1]) * weights[..., None]).to(dtype)
    if k == 1:
        return weighted[:, 0]
    order = ids.argsort(dim=1)
    weighted = weighted.gather(1, order[..., None].expand_as(weighted))
    out = weighted[:, 0]
    for j in range(1, k):  # NOTE: a loop over the k choices (not tokens): HF's rounding order
        out = out + weighted[:, j]
    return out


@dataclass(slots=True)
class SharedExpert:
    """Qwen2-MoE's always-on expert: `sigmoid(gate(h)) * swiglu(h)`, added to the routed sum."""

    gate_w: torch.Tensor
    up_w: torch.Tensor
    down_w: torch.Tensor
    scale_w: torch.Tensor  # [1, H]

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(h, self.scale_w)) * swiglu(h, self.gate_w, self.up_w, self.down_w)


@dataclass(slots=True)
class MoeLayer:
    """One sparse layer's tensors: the router, the local experts, the optional shared expert."""

    router_w: torch.Tensor  # [E, H]: every rank routes its own tokens over all experts
    experts: ExpertWeights
    shared: Optional[SharedExpert] = None
