"""Routing replay: the trainer routes every token to the experts the engine routed it to.

Engine and trainer compute the same MoE in different kernels (paged attention vs dense, other batch
shapes), so in bf16 a token whose top-k scores nearly tie often goes to different experts in the
two: its log-prob then differs by far more than rounding, and the policy gradient is computed for
a routing the engine never sampled under. The cure is to record the engine's choices
(`SamplingParams(return_routed_experts=True)` -> `RequestOutput.routed_experts`, `[tokens - 1,
moe_layers, k]`: the last sampled token never went through the model) and replay them:

```
routes = pad_routes([out.routed_experts for out in outputs], input_ids.shape[1])
with replay_routing(hf_model, routes) as used:
    logits = hf_model(input_ids).logits
```

`replay_routing` hooks the router (`mlp.gate`) of each sparse layer of an HF Qwen3-MoE /
Qwen2-MoE / Mixtral module: the router still computes its logits (so it trains as usual), but
its top-k experts are replaced by the given ones and their weights recomputed from its own scores
for those experts, exactly as the engine does (`moe.weights_for`). A given expert < 0 (padding,
a position the engine never computed) keeps the router's own choice. `used` collects, per sparse
layer, the experts each token of each forward actually went to (also without `routes`: then it
only records, which is how flips are measured). GRPO's step replays through the same hook
(`rollout.rl.grpo.grpo_step(routed_experts=...)`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import numpy as np
import torch

from inference.models.moe.layer import router_scores, weights_for
from inference.models.moe.spec import MoeSpec


def pad_routes(routes: Sequence[Optional[np.ndarray]], length: int) -> torch.Tensor:
    """Per-sample `[n_i, moe_layers, k]` arrays -> `[B, length, moe_layers, k]` int64, -1 where a
    sample has no route (past its end, or no array). Row b, position t: the experts of token t."""
    shape = next((r.shape[1:] for r in routes if r is not None), None)
    if shape is None:
        raise ValueError("pad_routes: no sample has routes (was return_routed_experts set?)")
    out = torch.full((len(routes), length, *shape), -1, dtype=torch.int64)
    for b, r in enumerate(routes):
        if r is not None:
            n = min(length, r.shape[0])
            out[b, :n] = torch.from_numpy(np.asarray(r[:n], dtype=np.int64))
    return out


def sparse_routers(model: torch.nn.Module) -> tuple[MoeSpec, list[torch.nn.Module]]:
    """The spec of an HF MoE `*ForCausalLM` and the router module of each sparse layer, in order."""
    spec = MoeSpec.from_hf_config(model.config)
    modules = dict(model.named_modules())
    routers = []
    for i in spec.sparse_layers:
        name = next((f"model.layers.{i}.{p}.gate" for p in ("mlp", "block_sparse_moe")
                     if f"model.layers.{i}.{p}.gate" in modules), None)
        if name is None:
            raise TypeError(f"replay_routing: {type(model).__name__} has no router for sparse layer {i}")
        routers.append(modules[name])
    return spec, routers


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routes: Optional[torch.Tensor] = None
                   ) -> Iterator[list[list[torch.Tensor]]]:
    """Within the block, forwards of `model` over `[B, T]` tokens route them as `routes [B, T,
    moe_layers, k]` says (see module docstring); yields `used[layer]`: one `[B * T, k]` tensor of
    the experts actually used per forward."""
    spec, routers = sparse_routers(model)
    if routes is not None and (routes.dim() != 4 or routes.shape[2:] != (len(routers), spec.top_k)):
        raise ValueError(f"replay_routing: routes must be [B, T, {len(routers)}, {spec.top_k}], "
                         f"got {tuple(routes.shape)}")
    used: list[list[torch.Tensor]] = [[] for _ in routers]
    router = spec.router

    def hook_for(j: int):
        def hook(module: Any, args: Any, output: Any) -> Any:
            logits, weights, ids = output
            if routes is not None:
                given = routes[:, :, j].reshape(-1, spec.top_k).to(ids.device)
                if given.shape[0] != ids.shape[0]:
                    raise ValueError(f"replay_routing: routes hold {given.shape[0]} tokens, the forward has "
                                     f"{ids.shape[0]}")
                ids = torch.where(given >= 0, given, ids)
                weights = weights_for(router_scores(logits, router), ids, router, logits.dtype)
            used[j].append(ids.detach())
            return logits, weights, ids

        return hook

    handles = [r.register_forward_hook(hook_for(j)) for j, r in enumerate(routers)]
    try:
        yield used
    finally:
        for h in handles:
            h.remove()


def routing_flips(engine_routes: torch.Tensor, trainer_routes: torch.Tensor) -> torch.Tensor:
    """Bool `[...]`: where the two choose a different *set* of k experts (order within the top-k
    does not matter: the weighted sum is the same). Inputs `[..., k]`."""
    return (engine_routes.sort(-1).values != trainer_routes.sort(-1).values).any(-1)
