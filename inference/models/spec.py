"""What the engine needs to know about a dense decoder, parsed from an HF `config.json`.

`ModelSpec` is a plain, validated description: sizes, which optional tensors exist (biases, q/k
norms, an untied LM head), RoPE parameters and the dtype. `weight_shapes()` lists every tensor by
its Hugging Face name, which is also the engine's name for it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelFamily(enum.Enum):
    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"


class RopeKind(enum.Enum):
    DEFAULT = "default"
    LINEAR = "linear"
    LLAMA3 = "llama3"


@dataclass(slots=True, frozen=True)
class RopeSpec:
    """Rotary embedding parameters (HF `rope_parameters`; llama3 fields only used by LLAMA3)."""

    theta: float = 10000.0
    kind: RopeKind = RopeKind.DEFAULT
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"RopeSpec.theta must be positive, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"RopeSpec.factor must be positive, got {self.factor}")
        if self.kind is RopeKind.LLAMA3 and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("RopeSpec.high_freq_factor must exceed low_freq_factor for llama3 scaling")


@dataclass(slots=True)
class ModelSpec:
    """A dense Llama-family decoder. Names and flags mirror HF transformers' configs."""

    family: ModelFamily
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeSpec = field(default_factory=RopeSpec)
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None  # set only when some layer really uses a window

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelSpec.head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in _DTYPES.values():
            raise ValueError(f"ModelSpec.dtype must be one of {list(_DTYPES)}, got {self.dtype}")
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the decoder needs, by HF name (tied models have no `lm_head.weight`)."""
        h, i = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            for proj, out_dim in (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)):
                shapes[p + f"self_attn.{proj}_proj.weight"] = (out_dim, h)
                if self.qkv_bias:
                    shapes[p + f"self_attn.{proj}_proj.bias"] = (out_dim,)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            for proj, (out_dim, in_dim) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
                shapes[p + f"mlp.{proj}_proj.weight"] = (out_dim, in_dim)
                if self.mlp_bias:
                    shapes[p + f"mlp.{proj}_proj.bias"] = (out_dim,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any] | Any,
        *,
        dtype: torch.dtype | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> ModelSpec:
        """Parse an HF config (a `config.json` dict or a `PretrainedConfig`).

        Raises NotImplementedError for what this decoder does not compute (other model types or
        activations, RoPE types other than default / linear / llama3, partial rotary).
        """
        cfg = dict(config) if isinstance(config, Mapping) else config.to_dict()
        model_type = cfg.get("model_type")
        try:
            family = ModelFamily(model_type)
        except ValueError:
            supported = [f.value for f in ModelFamily]
            raise NotImplementedError(f"model_type {model_type!r} is not a dense decoder here ({supported})") from None
        if cfg.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {cfg.get('hidden_act')!r}: only SwiGLU ('silu') is supported")
        heads = cfg["num_attention_heads"]
        attention_bias = bool(cfg.get("attention_bias") or False)
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            # Qwen2 hard-codes q/k/v biases (and none on o_proj); the others follow attention_bias
            qkv_bias=True if family is ModelFamily.QWEN2 else attention_bias,
            o_bias=False if family is ModelFamily.QWEN2 else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias") or False),
            qk_norm=family is ModelFamily.QWEN3,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=dtype or _parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype")),
            eos_token_ids=_merge_ids(cfg.get("eos_token_id"), extra_eos_token_ids),
            sliding_window=_parse_sliding_window(family, cfg),
        )


def _parse_rope(cfg: dict[str, Any]) -> RopeSpec:
    # transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = params.get("rope_theta", cfg.get("rope_theta") or 10000.0)
    kind_name = params.get("rope_type", params.get("type", "default"))
    try:
        kind = RopeKind(kind_name)
    except ValueError:
        raise NotImplementedError(f"rope_type {kind_name!r} is not supported ({[k.value for k in RopeKind]})") from None
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1 is not supported")
    if kind is RopeKind.DEFAULT:
        return RopeSpec(theta=float(theta))
    if kind is RopeKind.LINEAR:
        return RopeSpec(theta=float(theta), kind=kind, factor=float(params["factor"]))
    return RopeSpec(
        theta=float(theta),
        kind=kind,
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _parse_sliding_window(family: ModelFamily, cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if family in (ModelFamily.QWEN2, ModelFamily.QWEN3):
        layer_types = cfg.get("layer_types") or []
        if not cfg.get("use_sliding_window", False) and "sliding_attention" not in layer_types:
            return None
    return int(window)


def _parse_dtype(value: Any) -> torch.dtype:
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; expected one of {list(_DTYPES)}")
    return _DTYPES[name]


def _merge_ids(value: Any, extra: tuple[int, ...]) -> tuple[int, ...]:
    ids = [] if value is None else [value] if isinstance(value, int) else list(value)
    for t in extra:
        if t not in ids:
            ids.append(t)
    return tuple(ids)
