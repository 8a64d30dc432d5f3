"""What the engine needs to know about a hybrid attention + Mamba2 model, family-independent.

A hybrid is a stack of residual blocks `x = x + sum_m out_mult_m * mixer_m(norm(x) * in_mult_m)`.
A block has one mixer (attention, Mamba2 or an MLP) in Bamba and Nemotron-H, or several in
parallel (Falcon-H1's attention + Mamba2). Every tensor keeps its Hugging Face name, which is
also the engine's; `hybrid/loading.py` builds a `HybridSpec` from each family's config.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

from inference.models.hybrid.mamba2 import GateNorm, Mamba2Dims
from inference.models.spec import RopeSpec


class HybridFamily(enum.Enum):
    BAMBA = "bamba"
    NEMOTRON_H = "nemotron_h"
    FALCON_H1 = "falcon_h1"


class MixerKind(enum.Enum):
    ATTENTION = "attention"
    MAMBA = "mamba"
    SWIGLU = "swiglu"  # down(silu(gate(x)) * up(x))
    RELU2 = "relu2"  # down(relu(up(x)) ** 2), Nemotron-H


@dataclass(frozen=True, slots=True)
class MixerSpec:
    """One mixer of a block: its kind, its HF name prefix (`model.layers.3.mamba.`), multipliers."""

    kind: MixerKind
    prefix: str
    in_mult: float = 1.0
    out_mult: float = 1.0


@dataclass(frozen=True, slots=True)
class BlockSpec:
    """A residual block: `norm` is the HF name of its RMSNorm weight."""

    norm: str
    mixers: tuple[MixerSpec, ...]

    @property
    def mixes_sequence(self) -> bool:
        """Whether a token's output depends on other tokens (attention or Mamba)."""
        return any(m.kind in (MixerKind.ATTENTION, MixerKind.MAMBA) for m in self.mixers)


@dataclass(slots=True)
class HybridSpec:
    """A hybrid decoder's sizes, block pattern and tensor names (see module docstring)."""

    family: HybridFamily
    vocab_size: int
    hidden_size: int
    blocks: tuple[BlockSpec, ...]
    embed: str
    final_norm: str
    # attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: Optional[RopeSpec] = None  # None: no positional encoding (Nemotron-H)
    rotary_dim: Optional[int] = None  # rotated leading dims of each head (default: all)
    qkv_bias: bool = False
    o_bias: bool = False
    key_multiplier: float = 1.0
    # MLP
    intermediate_size: int = 0
    mlp_bias: bool = False
    gate_multiplier: float = 1.0
    down_multiplier: float = 1.0
    # Mamba2
    mamba: Optional[Mamba2Dims] = None
    conv_bias: bool = True
    in_proj_bias: bool = False
    out_proj_bias: bool = False
    # the rest
    rms_norm_eps: float = 1e-5
    norm_weight_fp32: bool = False  # Nemotron-H multiplies the norm weight in fp32 before the cast
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = field(default=())  # for display: the HF layer pattern

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"HybridSpec.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"HybridSpec.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.num_attention_layers == 0:
            raise NotImplementedError("a hybrid without attention layers (pure Mamba2) is not supported: the "
                                      "engine's prefix cache is keyed by its KV blocks")
        if self.num_mamba_layers and self.mamba is None:
            raise ValueError("HybridSpec: Mamba layers need `mamba` dimensions")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"HybridSpec.rotary_dim must be even and in (0, head_dim], got {self.rotary_dim}")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)

    # ---- counts ------------------------------------------------------------------------------

    def _count(self, kind: MixerKind) -> int:
        return sum(m.kind is kind for b in self.blocks for m in b.mixers)

    @property
    def num_attention_layers(self) -> int:
        return self._count(MixerKind.ATTENTION)

    @property
    def num_mamba_layers(self) -> int:
        return self._count(MixerKind.MAMBA)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ---- names -------------------------------------------------------------------------------

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the decoder needs, by HF name (tied models have no `lm_head.weight`)."""
        h = self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {self.embed: (self.vocab_size, h)}
        for block in self.blocks:
            shapes[block.norm] = (h,)
            for m in block.mixers:
                shapes.update(self._mixer_shapes(m))
        shapes[self.final_norm] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def _mixer_shapes(self, m: MixerSpec) -> dict[str, tuple[int, ...]]:
        h, p = self.hidden_size, m.prefix
        out: dict[str, tuple[int, ...]] = {}
        if m.kind is MixerKind.ATTENTION:
            for proj, size in (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)):
                out[f"{p}{proj}_proj.weight"] = (size, h)
                if self.qkv_bias:
                    out[f"{p}{proj}_proj.bias"] = (size,)
            out[f"{p}o_proj.weight"] = (h, self.q_size)
            if self.o_bias:
                out[f"{p}o_proj.bias"] = (h,)
        elif m.kind is MixerKind.MAMBA:
            d = self.mamba
            out[f"{p}in_proj.weight"] = (d.proj_dim, h)
            if self.in_proj_bias:
                out[f"{p}in_proj.bias"] = (d.proj_dim,)
            out[f"{p}conv1d.weight"] = (d.conv_dim, 1, d.conv_kernel)
            if self.conv_bias:
                out[f"{p}conv1d.bias"] = (d.conv_dim,)
            for name in ("dt_bias", "A_log", "D"):
                out[p + name] = (d.num_heads,)
            if d.gate_norm is not GateNorm.GATE_ONLY:
                out[f"{p}norm.weight"] = (d.intermediate,)
            out[f"{p}out_proj.weight"] = (h, d.intermediate)
            if self.out_proj_bias:
                out[f"{p}out_proj.bias"] = (h,)
        else:
            i = self.intermediate_size
            projs = (("up", (i, h)), ("down", (h, i)))
            if m.kind is MixerKind.SWIGLU:
                projs = (("gate", (i, h)),) + projs
            for proj, shape in projs:
                out[f"{p}{proj}_proj.weight"] = shape
                if self.mlp_bias:
                    out[f"{p}{proj}_proj.bias"] = (shape[0],)
        return out
