"""The model protocol: what the engine needs of any model it serves.

A model declares the caches it needs (`cache_specs()`: one paged KV cache for its attention
layers, plus per-request state for recurrent layers), runs one flat batch of prefill chunks and
decode tokens against them, and exposes its weights by HF name so they can be aliased, copied or
updated. The dense decoder implements it; hybrid (Mamba) and MoE models implement the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from inference.attention.base import AttentionBackend
from inference.attention.metadata import AttentionMetadata
from inference.cache.kv_buffer import KVCacheBuffer
from inference.cache.specs import CacheSpec


@dataclass(slots=True)
class VerifyRows:
    """A speculative verify step of a stateful model: request `b` owns `lens[b]` consecutive rows
    (its last token, then its proposed ones), each to be computed as a one-token decode after the
    rows before it. The recurrent layers leave the state rows as they were and append to `trail`
    what the model's `advance_states` needs to move each request's state over the rows it keeps."""

    lens: list[int]
    trail: list[Any] = field(default_factory=list)


@dataclass(slots=True)
class StateBatch:
    """Per-request state for one step: the pool's tensors (`name -> [slots + 1, *shape]`), the
    row of each request of the batch (`slots [B]`), and whether it starts from zero (`fresh [B]`,
    its first chunk). A recurrent layer reads its rows, runs the request's tokens, writes back.
    The first `num_decode` requests are decode steps (one sampled token each, state carried); the
    others are prefill chunks (Mamba2 clamps its step size in prefill only, as its reference does).
    With `verify`, the batch is a speculative verify step instead (`slots` one per request)."""

    tensors: Mapping[str, torch.Tensor]
    slots: torch.Tensor
    fresh: torch.Tensor
    num_decode: int = 0
    verify: Optional[VerifyRows] = None


@runtime_checkable
class CausalLM(Protocol):
    """What the engine calls; `spec` carries vocab size, EOS ids, dtype and `weight_shapes()`."""

    spec: Any
    device: torch.device
    backend: AttentionBackend

    def cache_specs(self) -> list[CacheSpec]: ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCacheBuffer,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        *,
        states: Optional[StateBatch] = None,
    ) -> torch.Tensor: ...

    def named_tensors(self) -> dict[str, torch.Tensor]: ...

    def bind_weights(self, tensors: Mapping[str, torch.Tensor], *, alias: bool) -> Any: ...
