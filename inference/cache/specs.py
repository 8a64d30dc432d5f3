"""What caches a model needs, declared by the model (`cache_specs()`) and built by the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Paged K/V for `num_layers` attention layers of `num_kv_heads` x `head_dim` each."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One kind of per-request state (e.g. one Mamba layer's SSM state): `shape` per request."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


CacheSpec = Union[KVCacheSpec, StateSpec]
