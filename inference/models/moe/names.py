"""The names of MoE tensors: the engine's, a checkpoint's on disk, a trainer's; and this rank's share.

The engine uses transformers >= 5 module names, experts fused per layer
(`mlp.experts.gate_up_proj [E, 2I, H]`, gate rows first; `mlp.experts.down_proj [E, H, I]`).
Checkpoints on disk (and older trainers) name each expert: Qwen
`mlp.experts.{e}.{gate,up,down}_proj.weight`, Mixtral `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`
(gate, up, down) and `block_sparse_moe.gate.weight` for the router. `localize_expert_tensors` maps
either to the engine's names and keeps this rank's experts: slices of fused tensors are views
(aliasing survives), per-expert tensors are stacked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from inference.errors import WeightNameError
from inference.models.dense.decoder import LM_HEAD
from inference.models.moe.spec import MoeSpec

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                         r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_MIXTRAL_ROUTER = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")


def localize_expert_tensors(spec: MoeSpec, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors named for the whole model (fused or per-expert names) -> the engine's names, this
    rank's experts only. Other names pass through; other ranks' experts are dropped. A layer whose
    per-expert tensors cover some but not all of this rank's experts is refused (WeightNameError)."""
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    first, n = spec.first_local_expert, spec.num_local_experts
    fused = set(spec.expert_names())
    for name, tensor in tensors.items():
        match = _PER_EXPERT.match(name)
        if match:
            layer, expert, role = int(match[1]), int(match[2]), _ROLE[match[3]]
            if first <= expert < first + n:
                per_expert.setdefault(layer, {}).setdefault(expert, {})[role] = tensor
            continue
        router = _MIXTRAL_ROUTER.match(name)
        if router:
            out[f"model.layers.{router[1]}.mlp.gate.weight"] = tensor
        elif name in fused and spec.ep_size > 1 and tensor.dim() == 3 and tensor.shape[0] == spec.num_experts:
            out[name] = tensor[first : first + n]  # a view: aliasing a trainer's tensor survives
        else:
            out[name] = tensor
    for layer, experts in per_expert.items():
        complete = [e for e in range(first, first + n) if len(experts.get(e, {})) == 3]
        if len(complete) != n:
            raise WeightNameError(
                f"layer {layer}: per-expert tensors must cover all of this rank's experts [{first}, {first + n}) "
                f"with gate, up and down in one call; got complete experts {complete}")
        rows = [experts[e] for e in range(first, first + n)]
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack([torch.cat((r["gate"], r["up"]), dim=0) for r in rows])
        out[p + "down_proj"] = torch.stack([r["down"] for r in rows])
    return out


def disk_names(root: Path) -> set[str]:
    """Every tensor name of a safetensors checkpoint directory (from its index, or its files' headers)."""
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in sorted(root.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def disk_sources(spec: MoeSpec, on_disk: set[str]) -> set[str]:
    """The checkpoint names holding what this rank needs: shared tensors, and its experts fused
    (whole, sliced after reading) or per expert (only its own are read)."""
    wanted: set[str] = set()
    fused = set(spec.expert_names())
    for name in spec.weight_shapes():
        if name in fused and name not in on_disk:
            layer, role = int(name.split(".")[2]), name.rsplit(".", 1)[1]
            prefix = f"model.layers.{layer}."
            experts = range(spec.first_local_expert, spec.first_local_expert + spec.num_local_experts)
            if any(n.startswith(prefix + "block_sparse_moe.") for n in on_disk):
                parts = ("w1", "w3") if role == "gate_up_proj" else ("w2",)
                wanted.update(f"{prefix}block_sparse_moe.experts.{e}.{p}.weight" for e in experts for p in parts)
            else:
                parts = ("gate_proj", "up_proj") if role == "gate_up_proj" else ("down_proj",)
                wanted.update(f"{prefix}mlp.experts.{e}.{p}.weight" for e in experts for p in parts)
        elif name.endswith("mlp.gate.weight") and name not in on_disk:
            wanted.add(name.replace(".mlp.gate.", ".block_sparse_moe.gate."))
        elif not (name == LM_HEAD and spec.tie_word_embeddings):
            wanted.add(name)
    return wanted
