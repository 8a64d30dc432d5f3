"""Names and layouts of a dense decoder's weights: HF (the engine's own) and megatron-core's GPTModel.

HF names are the engine's names (`ModelSpec.weight_shapes()`). Megatron-core (TP = PP = 1 here)
fuses two groups of HF tensors:

* `linear_qkv` `[ng * (q_per_group + 2) * d, H]` holds, for each of the `ng` query groups (KV
  heads) in turn, the group's q heads, then its k head, then its v head: `q1 q2 k1 v1 | q3 q4 k2
  v2 | ...` (see `SelfAttention.get_query_key_value_tensors`). HF's q / k / v are strided
  selections of it: row slices, hence *views*, only when `ng == 1`; otherwise no single strided
  tensor covers them and they are converted *copies*.
* `linear_fc1` `[2F, H]` is `[gate; up]` (megatron's `glu` chunks the output in two, silu on the
  first). Both halves are row slices, so always views; of a contiguous parameter they are
  contiguous views, and an in-place optimizer step on it shows through them.

Norms: the local layer spec keeps `input_layernorm` / `pre_mlp_layernorm` modules; Transformer
Engine's spec fuses them into the next linear as `linear_qkv.layer_norm_weight` /
`linear_fc1.layer_norm_weight`. Both spellings are read; `hf_to_megatron` writes either. Names may
carry wrapper prefixes (`module.` from DDP / Float16Module); `*._extra_state` entries of a
`state_dict()` hold no weights and are skipped. Nothing here modifies a tensor it is given.

Errors are the engine's own `WeightNameError` (a KeyError) and `WeightShapeError` (a ValueError)
from `inference.errors`, re-exported here, so one `except` catches them from either package.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from inference.errors import WeightNameError, WeightShapeError
from inference.models.spec import ModelFamily, ModelSpec, RopeKind, RopeSpec

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


class Naming(enum.Enum):
    HF = "hf"
    MEGATRON = "megatron"


class FusedLayout(enum.Enum):
    IDENTITY = "identity"  # one megatron tensor is one HF tensor
    QKV = "qkv"  # fused q / k / v, interleaved by query group
    GATE_UP = "gate_up"  # fused [gate; up] along rows


@dataclass(frozen=True, slots=True)
class MegatronTensor:
    """One megatron tensor: its canonical name, the HF tensors it holds (in order), its layout."""

    name: str
    hf_names: tuple[str, ...]
    layout: FusedLayout


# megatron suffix under `decoder.layers.{i}.` -> (layout, HF suffixes under `model.layers.{i}.`)
_LAYER = {
    "input_layernorm.weight": (FusedLayout.IDENTITY, ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": (FusedLayout.IDENTITY, ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (FusedLayout.QKV, tuple(f"self_attn.{p}_proj.weight" for p in "qkv")),
    "self_attention.linear_qkv.bias": (FusedLayout.QKV, tuple(f"self_attn.{p}_proj.bias" for p in "qkv")),
    "self_attention.q_layernorm.weight": (FusedLayout.IDENTITY, ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": (FusedLayout.IDENTITY, ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": (FusedLayout.IDENTITY, ("self_attn.o_proj.weight",)),
    "self_attention.linear_proj.bias": (FusedLayout.IDENTITY, ("self_attn.o_proj.bias",)),
    "pre_mlp_layernorm.weight": (FusedLayout.IDENTITY, ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": (FusedLayout.IDENTITY, ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": (FusedLayout.GATE_UP, ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc1.bias": (FusedLayout.GATE_UP, ("mlp.gate_proj.bias", "mlp.up_proj.bias")),
    "mlp.linear_fc2.weight": (FusedLayout.IDENTITY, ("mlp.down_proj.weight",)),
    "mlp.linear_fc2.bias": (FusedLayout.IDENTITY, ("mlp.down_proj.bias",)),
}
_FUSED_NORM = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
               "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}  # fmt: skip
_GLOBAL = {
    "embedding.word_embeddings.weight": EMBED,
    "decoder.final_layernorm.weight": FINAL_NORM,
    "output_layer.weight": LM_HEAD,
}
_HF_LAYER_SUFFIXES = {s for _, hf in _LAYER.values() for s in hf}
_LAYER_RE = re.compile(r"(?:decoder|model)\.layers\.(\d+)\.(.+)")
_WRAPPER = "module."
_EXTRA_STATE = "._extra_state"


def _strip(name: str) -> str:
    while name.startswith(_WRAPPER):
        name = name[len(_WRAPPER) :]
    return name


def naming_of(name: str) -> Naming | None:
    """Which naming `name` is spelled in, independent of any model's sizes (None: neither)."""
    name = _strip(name)
    if name in _GLOBAL:
        return Naming.MEGATRON
    if name in (EMBED, FINAL_NORM, LM_HEAD):
        return Naming.HF
    m = _LAYER_RE.fullmatch(name)
    if m is None:
        return None
    if name.startswith("decoder.") and m.group(2) in _LAYER:
        return Naming.MEGATRON
    if name.startswith("model.") and m.group(2) in _HF_LAYER_SUFFIXES:
        return Naming.HF
    return None


def detect_naming(names: Iterable[str]) -> Naming:
    """HF or MEGATRON; a `WeightNameError` for unknown names, a mix of both, or no names."""
    kinds, unknown = set(), []
    for name in names:
        if name.endswith(_EXTRA_STATE):
            continue
        kind = naming_of(name)
        if kind is None:
            unknown.append(name)
        kinds.add(kind)
    if unknown:
        raise WeightNameError(f"neither HF nor megatron-core tensor names: {unknown[:8]}")
    if len(kinds) != 1:
        raise WeightNameError("no tensor names" if not kinds else "names mix HF and megatron-core spellings")
    return kinds.pop()


# -- layouts -------------------------------------------------------------------------------------


def megatron_layout(spec: ModelSpec, *, fused_norms: bool = False) -> dict[str, MegatronTensor]:
    """Every megatron tensor of `spec`'s model by canonical name (tied: no `output_layer.weight`)."""
    hf = spec.weight_shapes()
    out: dict[str, MegatronTensor] = {}
    for name, target in _GLOBAL.items():
        if target in hf:
            out[name] = MegatronTensor(name, (target,), FusedLayout.IDENTITY)
    skip = set(_FUSED_NORM) if fused_norms else set(_FUSED_NORM.values())  # one spelling per norm
    for i in range(spec.num_layers):
        for suffix, (layout, hf_suffixes) in _LAYER.items():
            if suffix in skip:
                continue
            targets = tuple(f"model.layers.{i}.{s}" for s in hf_suffixes)
            if all(t in hf for t in targets):
                name = f"decoder.layers.{i}.{suffix}"
                out[name] = MegatronTensor(name, targets, layout)
    return out


def megatron_weight_shapes(spec: ModelSpec, *, fused_norms: bool = False) -> dict[str, tuple[int, ...]]:
    """Shape of every megatron tensor of `spec`'s model (fused rows are the HF rows summed)."""
    hf = spec.weight_shapes()
    return {
        name: (sum(hf[h][0] for h in t.hf_names), *hf[t.hf_names[0]][1:])
        for name, t in megatron_layout(spec, fused_norms=fused_norms).items()
    }


def strided_parts(fused: torch.Tensor, layout: FusedLayout, spec: ModelSpec) -> tuple[torch.Tensor, ...]:
    """The HF tensors inside `fused` as views of it, each one strided tensor.

    GATE_UP parts and IDENTITY are HF-shaped already. QKV parts keep the group dimension:
    q `[ng, q_per_group, d, ...]`, k and v `[ng, d, ...]`; `.view(hf_shape)` of them succeeds
    exactly when the layout allows an alias (`ng == 1`).
    """
    if layout is FusedLayout.IDENTITY:
        return (fused,)
    if layout is FusedLayout.GATE_UP:
        return tuple(fused.chunk(2, dim=0))
    per_group = spec.num_heads // spec.num_kv_heads
    grouped = fused.unflatten(0, (spec.num_kv_heads, per_group + 2, spec.head_dim))  # always a view
    return grouped[:, :per_group], grouped[:, per_group], grouped[:, per_group + 1]


def split(fused: torch.Tensor, layout: FusedLayout, spec: ModelSpec) -> tuple[torch.Tensor, ...]:
    """HF-shaped tensors from a fused one: views where the layout allows, else copies.

    Views: IDENTITY, both GATE_UP halves, and QKV when `spec.num_kv_heads == 1`. Copies: QKV
    with several query groups (each part's rows are spread over the groups).
    """
    parts = strided_parts(fused, layout, spec)
    if layout is not FusedLayout.QKV:
        return parts
    return tuple(p.reshape(-1, *fused.shape[1:]) for p in parts)  # reshape: a view iff one exists


def fuse(parts: tuple[torch.Tensor, ...], layout: FusedLayout, spec: ModelSpec) -> torch.Tensor:
    """The inverse of `split` (always a new tensor, except IDENTITY which returns its part)."""
    if layout is FusedLayout.IDENTITY:
        return parts[0]
    if layout is FusedLayout.GATE_UP:
        return torch.cat(parts, dim=0)
    q, k, v = parts
    ng, d = spec.num_kv_heads, spec.head_dim
    rest = q.shape[1:]
    q = q.reshape(ng, spec.num_heads // ng, d, *rest)
    k, v = k.reshape(ng, 1, d, *rest), v.reshape(ng, 1, d, *rest)
    return torch.cat((q, k, v), dim=1).reshape(-1, *rest)


# -- conversion ----------------------------------------------------------------------------------


def _as_dict(named: NamedTensors) -> dict[str, torch.Tensor]:
    pairs = named.items() if isinstance(named, Mapping) else named
    out: dict[str, torch.Tensor] = {}
    for name, tensor in pairs:
        if name in out:
            raise WeightNameError(f"tensor {name!r} is given twice")
        out[name] = tensor
    return out


def _check_shapes(tensors: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    bad = []
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise WeightShapeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")
        if tuple(t.shape) != shapes[name]:
            bad.append(f"{name}: {tuple(t.shape)} != expected {shapes[name]}")
    if bad:
        raise WeightShapeError(f"wrong shapes: {'; '.join(bad[:8])}")


def validate_megatron(
    tensors: Mapping[str, torch.Tensor], spec: ModelSpec, *, complete: bool = True
) -> dict[str, MegatronTensor]:
    """Check megatron-named tensors against `spec`; map each given name to its `MegatronTensor`.

    `WeightNameError` for a name this model does not have (unknown, layer out of range, a bias it
    lacks), an HF tensor held twice (both norm spellings), or, with `complete`, a missing tensor;
    then `WeightShapeError` for wrong shapes or non-floating dtypes, all before any conversion.
    `output_layer.weight` of a tied model is known (the engine ignores it, like `bind_weights`).
    """
    known = {**megatron_layout(spec), **megatron_layout(spec, fused_norms=True)}
    shapes = {**megatron_weight_shapes(spec), **megatron_weight_shapes(spec, fused_norms=True)}
    if spec.tie_word_embeddings:
        known["output_layer.weight"] = MegatronTensor("output_layer.weight", (LM_HEAD,), FusedLayout.IDENTITY)
        shapes["output_layer.weight"] = (spec.vocab_size, spec.hidden_size)
    out: dict[str, MegatronTensor] = {}
    unknown, hf_seen = [], {}
    for name in tensors:
        if name.endswith(_EXTRA_STATE):
            continue
        t = known.get(_strip(name))
        if t is None:
            unknown.append(name)
            continue
        for h in t.hf_names:
            if h in hf_seen:
                raise WeightNameError(f"{name} and {hf_seen[h]} both hold {h}")
            hf_seen[h] = name
        out[name] = t
    if unknown:
        hint = " (these are HF names: pass them as they are)" if naming_of(unknown[0]) is Naming.HF else ""
        raise WeightNameError(f"unknown megatron-core tensor names for this model: {unknown[:8]}{hint}")
    if complete:
        missing = [n for n, t in megatron_layout(spec).items() if not any(h in hf_seen for h in t.hf_names)]
        if missing:
            raise WeightNameError(f"missing megatron-core tensors: {missing[:8]}")
    _check_shapes({n: tensors[n] for n in out}, {n: shapes[t.name] for n, t in out.items()})
    return out


def megatron_to_hf(named: NamedTensors, spec: ModelSpec, *, complete: bool = True) -> dict[str, torch.Tensor]:
    """Megatron-named tensors -> HF-named ones, all names and shapes checked first.

    Views of the inputs where the layout allows (everything but q / k / v with several query
    groups, which are copies; see `split`). A tied model's `output_layer.weight` is dropped.
    """
    tensors = _as_dict(named)
    out: dict[str, torch.Tensor] = {}
    for name, t in validate_megatron(tensors, spec, complete=complete).items():
        if t.hf_names == (LM_HEAD,) and spec.tie_word_embeddings:
            continue
        out.update(zip(t.hf_names, split(tensors[name], t.layout, spec)))
    return out


def hf_to_megatron(
    named: NamedTensors, spec: ModelSpec, *, fused_norms: bool = False, complete: bool = True
) -> dict[str, torch.Tensor]:
    """HF-named tensors -> megatron-named ones (fused tensors are new; the rest are the inputs).

    A fused tensor needs all of its parts (q, k and v together; gate and up together).
    """
    tensors = _as_dict(named)
    expected = spec.weight_shapes()
    if spec.tie_word_embeddings:
        tensors.pop(LM_HEAD, None)
    unknown = [n for n in tensors if n not in expected]
    if unknown:
        raise WeightNameError(f"unknown HF tensor names for this model: {unknown[:8]}")
    if complete and (missing := [n for n in expected if n not in tensors]):
        raise WeightNameError(f"missing HF tensors: {missing[:8]}")
    _check_shapes(tensors, expected)
    out: dict[str, torch.Tensor] = {}
    for name, t in megatron_layout(spec, fused_norms=fused_norms).items():
        have = [h in tensors for h in t.hf_names]
        if any(have) and not all(have):
            lacking = [h for h, ok in zip(t.hf_names, have) if not ok]
            raise WeightNameError(f"{name} is fused from {list(t.hf_names)}: {lacking} missing")
        if all(have):
            out[name] = fuse(tuple(tensors[h] for h in t.hf_names), t.layout, spec)
    return out


# -- config --------------------------------------------------------------------------------------


def spec_from_megatron_config(
    config: Any,
    *,
    vocab_size: int,
    max_position_embeddings: int = 4096,
    rotary_base: float = 10000,
    rotary_percent: float = 1.0,
    rope_scaling: bool = False,
    rope_scaling_factor: float = 8.0,
    seq_len_interpolation_factor: float | None = None,
    position_embedding_type: str = "rope",
    tie_word_embeddings: bool = False,
    dtype: torch.dtype | None = None,
) -> ModelSpec:
    """The engine's `ModelSpec` for a megatron `TransformerConfig` plus the GPTModel arguments.

    Raises NotImplementedError, naming the field, for what the dense decoder does not compute
    the same way (LayerNorm, non-SwiGLU MLPs, interleaved or partial rotary, MoE, MLA, ...).
    """
    c = config

    def refuse(field: str, why: str) -> None:
        raise NotImplementedError(f"megatron config {field}: {why} is not supported by the dense decoder")

    if c.normalization != "RMSNorm":
        refuse("normalization", f"{c.normalization!r} (only RMSNorm)")
    if not c.gated_linear_unit or c.activation_func is not F.silu:
        refuse("gated_linear_unit/activation_func", "an MLP other than SwiGLU")
    if position_embedding_type != "rope":
        refuse("position_embedding_type", repr(position_embedding_type))
    if c.rotary_interleaved:
        refuse("rotary_interleaved", "interleaved (GPT-J style) rotary")
    if rotary_percent != 1.0:
        refuse("rotary_percent", f"partial rotary ({rotary_percent})")
    for field, default in (
        ("num_moe_experts", None),
        ("multi_latent_attention", False),
        ("attention_output_gate", False),
        ("qk_l2_norm", False),
        ("layernorm_zero_centered_gamma", False),
        ("apply_residual_connection_post_layernorm", False),
        ("softmax_type", "vanilla"),
        ("window_size", None),
        ("no_rope_freq", None),
        ("softmax_scale", None),
    ):
        if getattr(c, field, default) != default:
            refuse(field, repr(getattr(c, field)))
    if rope_scaling and seq_len_interpolation_factor:
        refuse("rope_scaling", "llama3 scaling together with position interpolation")
    if rope_scaling:  # megatron's `_apply_scaling` defaults: low 1, high 4, original length 8192
        rope = RopeSpec(theta=float(rotary_base), kind=RopeKind.LLAMA3, factor=float(rope_scaling_factor))
    elif seq_len_interpolation_factor:
        rope = RopeSpec(theta=float(rotary_base), kind=RopeKind.LINEAR, factor=float(seq_len_interpolation_factor))
    else:
        rope = RopeSpec(theta=float(rotary_base))
    linear_bias = bool(c.add_bias_linear)
    qkv_bias = linear_bias or bool(c.add_qkv_bias)  # megatron's linear_qkv bias follows either flag
    qk_norm = bool(c.qk_layernorm)
    family = ModelFamily.QWEN3 if qk_norm else ModelFamily.QWEN2 if qkv_bias and not linear_bias else ModelFamily.LLAMA
    return ModelSpec(
        family=family,
        vocab_size=int(vocab_size),
        hidden_size=c.hidden_size,
        intermediate_size=c.ffn_hidden_size,
        num_layers=c.num_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_query_groups or c.num_attention_heads,
        head_dim=c.kv_channels or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=float(c.layernorm_epsilon),
        rope=rope,
        max_position_embeddings=int(max_position_embeddings),
        qkv_bias=qkv_bias,
        o_bias=linear_bias,
        mlp_bias=linear_bias,
        qk_norm=qk_norm,
        tie_word_embeddings=bool(tie_word_embeddings),
        dtype=dtype or c.params_dtype,
    )
