"""Megatron-core tensor-parallel shards gathered into whole tensors on the sender (TP rank 0).

Megatron marks each sharded parameter (`tensor_model_parallel`, `partition_dim`): column-parallel
ones (linear_qkv, linear_fc1, the vocabulary-parallel embedding and output layer, their biases)
split their rows, row-parallel ones (linear_proj, linear_fc2) their columns; the rest (norms,
row-parallel biases) are whole on every rank. Whole tensors are the shards concatenated in rank
order along that dimension, with one exception: a gated MLP's `linear_fc1` holds `[gate_i; up_i]`
on rank i (its GLU chunks the local output in two), so the whole tensor is
`[gate_0; ...; gate_n; up_0; ...; up_n]`, the `[gate; up]` layout the engine reads. linear_qkv
needs no such care: each rank holds whole query groups, in order.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from weight_sync.megatron.model import is_gpt_model, unwrap

_GLU_SUFFIXES = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")


def _tp_group(tp_group: Any) -> Any:
    if tp_group is not None:
        return tp_group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def tensor_parallel_size(module: Any, tp_group: Any = None) -> int:
    """The module's tensor-parallel degree (1 for anything but a TP-sharded megatron-core model)."""
    if tp_group is not None:
        return dist.get_world_size(tp_group)
    if not is_gpt_model(module):
        return 1
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def merge_shards(name: str, shards: list[torch.Tensor], partition_dim: int, *, glu: bool) -> torch.Tensor:
    """One parameter's whole tensor from its shards in rank order (see module docstring)."""
    if len(shards) == 1 or partition_dim < 0:
        return shards[0]
    if glu and name.endswith(_GLU_SUFFIXES):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=partition_dim)


def gather_tensor_parallel(module: Any, tp_group: Any = None) -> Optional[list[tuple[str, torch.Tensor]]]:
    """Every parameter of `module` whole, by megatron name, on TP rank 0; None on the others.
    A collective: every rank of the TP group calls it, with the same parameters in the same order."""
    group = _tp_group(tp_group)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    glu = bool(getattr(getattr(unwrap(module), "config", None), "gated_linear_unit", False))
    out: list[tuple[str, torch.Tensor]] = []
    for name, param in module.named_parameters():
        local = param.detach()
        if getattr(param, "tensor_model_parallel", False) and size > 1:
            shards = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(shards, local.contiguous(), group=group)
            if rank == 0:
                out.append((name, merge_shards(name, shards, int(param.partition_dim), glu=glu)))
        elif rank == 0:
            out.append((name, local))
    return out if rank == 0 else None
