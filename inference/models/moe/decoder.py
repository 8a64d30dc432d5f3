"""The MoE decoder: the dense decoder's attention blocks, with routed experts as the MLP of its
sparse layers, optionally expert-parallel across processes.

Like `DenseDecoder` it is functional over HF-named tensors (transformers >= 5 module names), so it
can alias a trainer's parameters or hold copies. An expert-parallel rank holds only its slice of
the experts (`spec.ep_rank` of `spec.ep_size`); everything else is replicated. Incoming weights
(an update, a trainer to bind) may name the whole model: `localize_weights` keeps this rank's
experts (views, no copy) and also accepts the per-expert names checkpoints use on disk.

Routing can be recorded: with `routes` active, every MoE layer writes its chosen experts per token
into `routes.buffer [moe_layers, tokens, k]`, which the engine hands to the requests that asked
(routing replay in the trainer, `inference/models/moe/routing_replay.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from inference.attention.base import AttentionBackend
from inference.models.dense.decoder import BindReport, DenseDecoder
from inference.models.moe.dispatch import LocalDispatch
from inference.models.moe.layer import ExpertWeights, MoeLayer, SharedExpert, combine, route
from inference.models.moe.names import localize_expert_tensors
from inference.models.moe.spec import MoeSpec


class RouteRecorder:
    """Where MoE layers write their chosen experts during a step (`buffer[layer, token, choice]`).

    The buffer keeps its address once sized (a captured CUDA graph writes into it on replay)."""

    def __init__(self, num_layers: int, top_k: int, device: torch.device) -> None:
        self.active = False
        self.buffer = torch.zeros(num_layers, 0, top_k, dtype=torch.int32, device=device)

    def ensure(self, max_tokens: int) -> None:
        if self.buffer.shape[1] < max_tokens:
            layers, _, k = self.buffer.shape
            self.buffer = torch.zeros(layers, max_tokens, k, dtype=torch.int32, device=self.buffer.device)


class MoeDecoder(DenseDecoder):
    """A Qwen2-MoE / Qwen3-MoE / Mixtral decoder over a paged KV cache (see module docstring).

    Invariants: those of `DenseDecoder`, with `named_tensors()` holding this rank's experts only;
    every rank of an expert-parallel group calls each MoE layer's exchange once per step, in layer
    order (`static_shapes` set alike on all of them).
    """

    # NOTE: LoRA adapts attention and dense-MLP layers (the dense decoder's `lora_targets`); the
    # experts are fused `[E, ...]` tensors run by the dispatcher, which takes no per-row update
    lora_limits = "; in MoE models the experts and shared experts are not adapted (only attention and dense MLPs)"

    def __init__(self, spec: MoeSpec, tensors: Mapping[str, torch.Tensor], *,
                 backend: Optional[AttentionBackend] = None, expert_parallel: Any = None) -> None:
        dispatch = expert_parallel if expert_parallel is not None else LocalDispatch(spec.num_experts)
        if (dispatch.world_size, dispatch.rank) != (spec.ep_size, spec.ep_rank):
            raise ValueError(f"MoeDecoder: spec is EP rank {spec.ep_rank} of {spec.ep_size}, the dispatcher "
                             f"{dispatch.rank} of {dispatch.world_size}")
        self.dispatch = dispatch
        self.expert_parallel = expert_parallel  # None: every expert lives here
        self.static_shapes = False  # True while CUDA graphs capture: no host sync, fixed-shape exchanges
        self.routes = RouteRecorder(len(spec.sparse_layers), spec.top_k, next(iter(tensors.values())).device)
        super().__init__(spec, tensors, backend=backend)

    def _resolve(self) -> None:
        super()._resolve()
        t, s = self._tensors, self.spec
        self._moe: dict[int, tuple[int, MoeLayer]] = {}
        for j, i in enumerate(s.sparse_layers):
            p = f"model.layers.{i}.mlp."
            shared = None
            if s.shared_expert_intermediate_size:
                shared = SharedExpert(*(t[p + f"shared_expert.{n}_proj.weight"] for n in ("gate", "up", "down")),
                                      t[p + "shared_expert_gate.weight"])
            layer = MoeLayer(t[p + "gate.weight"], ExpertWeights(t[p + "experts.gate_up_proj"],
                                                                 t[p + "experts.down_proj"]), shared)
            self._moe[i] = (j, layer)
        self._router = s.router

    # ---- weights -----------------------------------------------------------------------------

    def localize_weights(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole-model tensors by name -> this rank's (see `names.localize_expert_tensors`)."""
        return localize_expert_tensors(self.spec, tensors)

    def bind_weights(self, tensors: Mapping[str, torch.Tensor], *, alias: bool) -> BindReport:
        return super().bind_weights(self.localize_weights(tensors), alias=alias)

    def expert_bytes(self) -> int:
        """Bytes of expert storage this process keeps alive (storages counted once, views of a
        larger storage count it whole: what is resident, not what is addressed)."""
        seen: dict[int, int] = {}
        for name in self.spec.expert_names():
            storage = self._tensors[name].untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    # ---- forward -----------------------------------------------------------------------------

    @property
    def trim_last_layer(self) -> bool:
        # NOTE: the last layer routes every token when routes are recorded (or shapes are fixed)
        return not (self.routes.active or self.static_shapes)

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        entry = self._moe.get(i)
        if entry is None:
            return super().mlp(i, h)
        j, layer = entry
        ids, weights = route(h, layer.router_w, self._router)
        if self.routes.active:
            self.routes.buffer[j, : ids.shape[0]].copy_(ids)
        out = combine(self.dispatch.run(h, ids, layer.experts, static=self.static_shapes), ids, weights, h.dtype)
        if layer.shared is not None:
            out = out + layer.shared(h)
        return out

    def __repr__(self) -> str:
        s = self.spec
        return (f"MoeDecoder({s.moe_family.value}, layers={s.num_layers}, sparse={len(s.sparse_layers)}, "
                f"experts={s.num_experts} top-{s.top_k} (local {s.num_local_experts}, EP rank {s.ep_rank} of "
                f"{s.ep_size}), hidden={s.hidden_size}, {s.dtype}, {self.device}, backend={self.backend.kind.value})")
