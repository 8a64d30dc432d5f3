"""The one interface every attention backend implements.

Life cycle per engine step: `plan(meta, kv_cache)` once (derive everything that does not depend
on the layer: group split, gather indices, masks, flashinfer plans), then `forward(...)` once per
layer. A backend holds the current step's plan; `forward` before any `plan` is an error.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import torch

from inference.attention.metadata import AttentionMetadata
from inference.cache.kv_buffer import KVCacheBuffer


class AttentionBackendKind(enum.Enum):
    TORCH = "torch"
    FLASHINFER = "flashinfer"


class AttentionBackend(ABC):
    """Paged causal attention over a flat batch of prefill chunks and decode tokens.

    Invariant: `forward` writes this step's K/V into the buffer *before* attending, so a query
    sees its own token's K/V and every earlier one of its request (`seq_lens` counts them all).
    Query heads map to KV heads as in HF's `repeat_kv`: query head `h` uses KV head `h // G`,
    `G = num_heads // num_kv_heads`.
    """

    kind: AttentionBackendKind

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scale: float | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        self.dtype = dtype
        self.device = torch.device(device)

    def release_workspace(self) -> int:
        """Drop per-step scratch buffers kept between steps (suspend frees them); returns their
        bytes. Backends without scratch buffers have nothing to drop."""
        return 0

    @abstractmethod
    def plan(self, meta: AttentionMetadata, kv_cache: KVCacheBuffer) -> None:
        """Prepare the step described by `meta`; called once per step, before any `forward`."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCacheBuffer,
    ) -> torch.Tensor:
        """Append `k`, `v` (`[T, Hkv, D]`) at the planned slots of `layer`, attend with `q`
        (`[T, Hq, D]`, RoPE applied) and return `[T, Hq * D]` in `q`'s dtype."""
