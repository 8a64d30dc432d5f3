"""What the engine needs to know about an MoE decoder, parsed from an HF `config.json`.

`MoeSpec` is a `ModelSpec` (attention, norms, RoPE, embeddings: the dense decoder's) plus the
sparse layers: which layers route, over how many experts, top-k, scoring, whether the k weights
are renormalised, the expert and shared-expert sizes, and which slice of the experts this
expert-parallel rank holds (`ep_rank` of `ep_size`). `weight_shapes()` lists the engine's tensors
by their HF module names (transformers >= 5: `mlp.experts.gate_up_proj [E, 2I, H]`,
`mlp.experts.down_proj [E, H, I]`), with only this rank's experts along the first dimension.

Families: Qwen3-MoE (Qwen3 attention with q/k norms), Qwen2-MoE (Qwen2 attention, a gated shared
expert) and Mixtral (Mistral attention, always renormalised, fp32 routing weights).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from inference.models.moe.layer import RouterSpec, Scoring
from inference.models.spec import ModelSpec


class MoeFamily(enum.Enum):
    QWEN3_MOE = "qwen3_moe"
    QWEN2_MOE = "qwen2_moe"
    MIXTRAL = "mixtral"


MOE_MODEL_TYPES = frozenset(f.value for f in MoeFamily)
_DENSE_EQUIVALENT = {MoeFamily.QWEN3_MOE: "qwen3", MoeFamily.QWEN2_MOE: "qwen2", MoeFamily.MIXTRAL: "mistral"}


def is_moe_config(config: Mapping[str, Any] | Any) -> bool:
    model_type = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    return model_type in MOE_MODEL_TYPES


@dataclass(slots=True)
class MoeSpec(ModelSpec):
    """A dense decoder's spec whose layers in `sparse_layers` replace the MLP with routed experts.

    Invariants: `num_experts % ep_size == 0`; this rank's experts are
    `[ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size)`.
    """

    moe_family: MoeFamily = MoeFamily.QWEN3_MOE
    num_experts: int = 1
    top_k: int = 1
    moe_intermediate_size: int = 1
    scoring: Scoring = Scoring.SOFTMAX
    normalize_topk: bool = False
    fp32_routing_weights: bool = False
    shared_expert_intermediate_size: int = 0  # 0: none
    sparse_layers: tuple[int, ...] = ()
    ep_size: int = 1
    ep_rank: int = 0

    def __post_init__(self) -> None:
        ModelSpec.__post_init__(self)  # NOTE: not super(): zero-arg super breaks in slotted dataclasses
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoeSpec.top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.ep_size < 1 or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"MoeSpec: ep_rank {self.ep_rank} is not a rank of ep_size {self.ep_size}")
        if self.num_experts % self.ep_size:
            raise ValueError(f"MoeSpec: {self.num_experts} experts cannot be split over ep_size {self.ep_size}")
        if any(not 0 <= i < self.num_layers for i in self.sparse_layers):
            raise ValueError(f"MoeSpec.sparse_layers {self.sparse_layers} outside [0, {self.num_layers})")
        self.scoring = Scoring(self.scoring)

    @property
    def router(self) -> RouterSpec:
        return RouterSpec(self.num_experts, self.top_k, self.scoring, self.normalize_topk, self.fp32_routing_weights)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_local_expert(self) -> int:
        return self.ep_rank * self.num_local_experts

    def with_expert_parallel(self, ep_size: int, ep_rank: int) -> MoeSpec:
        return dataclasses.replace(self, ep_size=ep_size, ep_rank=ep_rank)

    def expert_names(self) -> list[str]:
        """The fused expert tensors (the ones expert parallelism splits), by HF module name."""
        return [f"model.layers.{i}.mlp.experts.{p}" for i in self.sparse_layers for p in ("gate_up_proj", "down_proj")]

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        dense = ModelSpec.weight_shapes(self)
        h, i, e = self.hidden_size, self.moe_intermediate_size, self.num_local_experts
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in dense.items():
            layer = _layer_of(name)
            if layer is not None and layer in self.sparse_layers and ".mlp." in name:
                continue
            shapes[name] = shape
        for n in self.sparse_layers:
            p = f"model.layers.{n}.mlp."
            shapes[p + "gate.weight"] = (self.num_experts, h)
            shapes[p + "experts.gate_up_proj"] = (e, 2 * i, h)
            shapes[p + "experts.down_proj"] = (e, h, i)
            s = self.shared_expert_intermediate_size
            if s:
                shapes[p + "shared_expert.gate_proj.weight"] = (s, h)
                shapes[p + "shared_expert.up_proj.weight"] = (s, h)
                shapes[p + "shared_expert.down_proj.weight"] = (h, s)
                shapes[p + "shared_expert_gate.weight"] = (1, h)
        return shapes

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | Any, *, dtype: torch.dtype | None = None,
                       extra_eos_token_ids: tuple[int, ...] = ()) -> MoeSpec:
        """Parse a Qwen3-MoE, Qwen2-MoE or Mixtral config (a `config.json` dict or a `PretrainedConfig`)."""
        cfg = dict(config) if isinstance(config, Mapping) else config.to_dict()
        try:
            family = MoeFamily(cfg.get("model_type"))
        except ValueError:
            raise NotImplementedError(f"model_type {cfg.get('model_type')!r} is not an MoE family here "
                                      f"({sorted(MOE_MODEL_TYPES)})") from None
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        layers = cfg["num_hidden_layers"]
        if family is MoeFamily.MIXTRAL:
            moe = dict(moe_intermediate_size=cfg["intermediate_size"], normalize_topk=True,
                       fp32_routing_weights=True, sparse_layers=tuple(range(layers)))
        else:
            step, dense_only = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
            moe = dict(moe_intermediate_size=cfg["moe_intermediate_size"],
                       normalize_topk=bool(cfg.get("norm_topk_prob", False)),
                       sparse_layers=tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0),
                       shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
                       if family is MoeFamily.QWEN2_MOE else 0)
        dense = ModelSpec.from_hf_config({**cfg, "model_type": _DENSE_EQUIVALENT[family]}, dtype=dtype,
                                         extra_eos_token_ids=extra_eos_token_ids)
        fields = {f.name: getattr(dense, f.name) for f in dataclasses.fields(ModelSpec)}
        if family is MoeFamily.QWEN2_MOE:  # NOTE: Qwen2-MoE reads `qkv_bias` where dense Qwen2 hard-codes it
            fields["qkv_bias"] = bool(cfg.get("qkv_bias", True))
        return cls(**fields, moe_family=family, num_experts=int(experts), top_k=int(cfg["num_experts_per_tok"]),
                   scoring=Scoring(cfg.get("scoring_func", "softmax")), **moe)


def _layer_of(name: str) -> int | None:
    if not name.startswith("model.layers."):
        return None
    return int(name.split(".")[2])
