"""Hybrid families' HF configs and weights: Bamba (and Granite 4 dense hybrids' layout),
Nemotron-H and Falcon-H1, into a `HybridDecoder`.

Each family names its tensors and spells its config its own way; this module maps them onto one
`HybridSpec`. Loading follows the dense loaders: from a directory (`config.json` +
`*.safetensors`, no `transformers` needed) or from a live `*ForCausalLM`, aliasing its
parameters with `share_weights` (HF's layout is the engine's, so only dtype / device force a
copy). Nemotron-H's MoE layers ("E") and MTP heads are not supported (NotImplementedError).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from inference.attention.base import AttentionBackend
from inference.models.dense.decoder import LM_HEAD, bind_module_tensors
from inference.models.hybrid.decoder import HybridDecoder
from inference.models.hybrid.mamba2 import GateNorm, Mamba2Dims
from inference.models.hybrid.spec import BlockSpec, HybridFamily, HybridSpec, MixerKind, MixerSpec
from inference.models.spec import _merge_ids, _parse_dtype, _parse_rope

logger = logging.getLogger(__name__)

HYBRID_MODEL_TYPES = frozenset(f.value for f in HybridFamily)
_SCAN_CHUNK_CAP = 64  # NOTE: the SSD chunk only trades compute for memory; 64 suits CPU caches


def is_hybrid_config(config: Mapping[str, Any] | Any) -> bool:
    cfg = config if isinstance(config, Mapping) else {"model_type": getattr(config, "model_type", None)}
    return cfg.get("model_type") in HYBRID_MODEL_TYPES


def hybrid_spec_from_config(config: Mapping[str, Any] | Any, *, dtype: torch.dtype | None = None,
                            extra_eos_token_ids: tuple[int, ...] = ()) -> HybridSpec:
    """Parse an HF config (a `config.json` dict or a `PretrainedConfig`) of a hybrid family."""
    cfg = dict(config) if isinstance(config, Mapping) else config.to_dict()
    family = HybridFamily(cfg.get("model_type"))
    parse = {HybridFamily.BAMBA: _bamba, HybridFamily.NEMOTRON_H: _nemotron_h, HybridFamily.FALCON_H1: _falcon_h1}
    fields = parse[family](cfg)
    heads = cfg["num_attention_heads"]
    return HybridSpec(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg.get("intermediate_size") or 0,
        mlp_bias=bool(cfg.get("mlp_bias") or False),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        dtype=dtype or _parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype")),
        eos_token_ids=_merge_ids(cfg.get("eos_token_id"), extra_eos_token_ids),
        **fields,
    )


def _mamba_dims(cfg: dict, *, heads: int, head_dim: int, state: int, groups: int, kernel: int, chunk: int,
                dt_limit: tuple[float, float], eps: float, **extra: Any) -> Mamba2Dims:
    return Mamba2Dims(hidden_size=cfg["hidden_size"], num_heads=heads, head_dim=head_dim, state_size=state,
                      n_groups=groups, conv_kernel=kernel, chunk_size=min(chunk, _SCAN_CHUNK_CAP),
                      dt_min=_as_float(dt_limit[0]), dt_max=_as_float(dt_limit[1]), norm_eps=eps, **extra)


def _as_float(value: Any) -> float:
    """A config float; transformers writes infinity to `config.json` as `{"__float__": "Infinity"}`."""
    if isinstance(value, Mapping) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def _check_act(cfg: dict, key: str, expected: str) -> None:
    if cfg.get(key, expected) != expected:
        raise NotImplementedError(f"{key}={cfg.get(key)!r}: only {expected!r} is supported")


def _bamba(cfg: dict) -> dict[str, Any]:
    _check_act(cfg, "hidden_act", "silu")
    n = cfg["num_hidden_layers"]
    attn = set(cfg.get("attn_layer_indices") or [])
    heads = cfg["mamba_n_heads"]
    inter = cfg["mamba_expand"] * cfg["hidden_size"]
    head_dim = cfg.get("mamba_d_head")
    head_dim = inter // heads if head_dim in (None, "auto") else int(head_dim)
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    blocks = []
    for i in range(n):
        p = f"model.layers.{i}."
        mixer = MixerSpec(MixerKind.ATTENTION, p + "self_attn.") if i in attn else MixerSpec(MixerKind.MAMBA,
                                                                                             p + "mamba.")
        blocks += [BlockSpec(p + "input_layernorm.weight", (mixer,)),
                   BlockSpec(p + "pre_ff_layernorm.weight", (MixerSpec(MixerKind.SWIGLU, p + "feed_forward."),))]
    attention_bias = bool(cfg.get("attention_bias") or False)
    rope, rotary_dim = _rope(cfg, partial=0.5)  # NOTE: Bamba's config hard-codes partial_rotary_factor 0.5
    return dict(
        blocks=tuple(blocks), embed="model.embed_tokens.weight", final_norm="model.final_layernorm.weight",
        rope=rope, rotary_dim=rotary_dim, qkv_bias=attention_bias, o_bias=attention_bias,
        mamba=_mamba_dims(cfg, heads=heads, head_dim=head_dim, state=cfg["mamba_d_state"],
                          groups=cfg.get("mamba_n_groups") or 1, kernel=cfg.get("mamba_d_conv") or 4,
                          chunk=cfg.get("mamba_chunk_size") or 256,
                          dt_limit=tuple(cfg.get("time_step_limit") or (0.0, float("inf"))), eps=eps),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)), in_proj_bias=bool(cfg.get("mamba_proj_bias") or False),
        out_proj_bias=bool(cfg.get("mamba_proj_bias") or False), rms_norm_eps=eps,
        layer_types=tuple("attention" if i in attn else "mamba" for i in range(n)),
    )


_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _nemotron_h(cfg: dict) -> dict[str, Any]:
    types = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not types and cfg.get("hybrid_override_pattern"):
        types = [_NEMOTRON_PATTERN[c] for c in cfg["hybrid_override_pattern"]]
    if not types:
        raise ValueError("nemotron_h config has neither layers_block_type nor hybrid_override_pattern")
    if "moe" in types:
        raise NotImplementedError("Nemotron-H MoE layers ('E') are not supported by the hybrid decoder")
    if int(cfg.get("num_nextn_predict_layers") or 0):
        logger.info("nemotron_h: the %s MTP layers are ignored", cfg["num_nextn_predict_layers"])
    _check_act(cfg, "mlp_hidden_act", "relu2")
    _check_act(cfg, "mamba_hidden_act", "silu")
    kind = {"linear_attention": MixerKind.MAMBA, "full_attention": MixerKind.ATTENTION, "mlp": MixerKind.RELU2}
    blocks = tuple(BlockSpec(f"model.layers.{i}.norm.weight", (MixerSpec(kind[t], f"model.layers.{i}.mixer."),))
                   for i, t in enumerate(types))
    eps = float(cfg.get("layer_norm_epsilon", 1e-5))
    use_bias = bool(cfg.get("use_bias") or False)
    # NOTE: HF's Nemotron-H mixer clamps prefill dt at time_step_min (its config's time_step_limit is unused)
    dt_limit = (float(cfg.get("time_step_min", 0.001)), float("inf"))
    return dict(
        blocks=blocks, embed="model.embeddings.weight", final_norm="model.norm_f.weight", rope=None,
        mamba=_mamba_dims(cfg, heads=cfg["mamba_num_heads"], head_dim=cfg["mamba_head_dim"],
                          state=cfg["ssm_state_size"], groups=cfg.get("n_groups") or 1,
                          kernel=cfg.get("conv_kernel") or 4, chunk=cfg.get("chunk_size") or 128,
                          dt_limit=dt_limit, eps=eps),
        conv_bias=bool(cfg.get("use_conv_bias", True)), in_proj_bias=use_bias, out_proj_bias=use_bias,
        rms_norm_eps=eps, norm_weight_fp32=True, layer_types=tuple(types),
    )


def _falcon_h1(cfg: dict) -> dict[str, Any]:
    _check_act(cfg, "hidden_act", "silu")
    n = cfg["num_hidden_layers"]
    heads = cfg["mamba_n_heads"]
    inter = cfg.get("mamba_d_ssm") or cfg["mamba_expand"] * cfg["hidden_size"]
    head_dim = cfg.get("mamba_d_head")
    head_dim = inter // heads if head_dim in (None, "auto") else int(head_dim)
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    ssm_out = float(cfg.get("ssm_out_multiplier", 1.0))
    attn_in, attn_out = float(cfg.get("attention_in_multiplier", 1.0)), float(cfg.get("attention_out_multiplier", 1.0))
    blocks = []
    for i in range(n):
        p = f"model.layers.{i}."
        blocks += [BlockSpec(p + "input_layernorm.weight", (MixerSpec(MixerKind.MAMBA, p + "mamba.", 1.0, ssm_out),
                                                           MixerSpec(MixerKind.ATTENTION, p + "self_attn.", attn_in,
                                                                     attn_out))),
                   BlockSpec(p + "pre_ff_layernorm.weight", (MixerSpec(MixerKind.SWIGLU, p + "feed_forward."),))]
    if not cfg.get("mamba_rms_norm", False):
        gate_norm = GateNorm.GATE_ONLY
    elif cfg.get("mamba_norm_before_gate", True):
        gate_norm = GateNorm.NORM_THEN_GATE
    else:
        gate_norm = GateNorm.GATE_THEN_NORM
    mlp_mult = cfg.get("mlp_multipliers") or (1.0, 1.0)
    attention_bias = bool(cfg.get("attention_bias") or False)
    rope, rotary_dim = _rope(cfg)
    return dict(
        blocks=tuple(blocks), embed="model.embed_tokens.weight", final_norm="model.final_layernorm.weight",
        rope=rope, rotary_dim=rotary_dim, qkv_bias=attention_bias, o_bias=attention_bias,
        key_multiplier=float(cfg.get("key_multiplier", 1.0)),
        gate_multiplier=float(mlp_mult[0]), down_multiplier=float(mlp_mult[1]),
        mamba=_mamba_dims(cfg, heads=heads, head_dim=head_dim, state=cfg["mamba_d_state"],
                          groups=cfg.get("mamba_n_groups") or 1, kernel=cfg.get("mamba_d_conv") or 4,
                          chunk=cfg.get("mamba_chunk_size") or 256,
                          dt_limit=tuple(cfg.get("time_step_limit") or (0.0, float("inf"))), eps=eps,
                          gate_norm=gate_norm, in_multiplier=float(cfg.get("ssm_in_multiplier", 1.0)),
                          proj_multipliers=tuple(float(m) for m in (cfg.get("ssm_multipliers") or (1.0,) * 5))),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)), in_proj_bias=bool(cfg.get("mamba_proj_bias") or False),
        out_proj_bias=bool(cfg.get("projectors_bias") or False), rms_norm_eps=eps,
        embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
        lm_head_multiplier=float(cfg.get("lm_head_multiplier", 1.0)),
        layer_types=("attention+mamba",) * n,
    )


def _rope(cfg: dict, partial: float | None = None):
    """(RopeSpec, rotated dims per head) from the config; `partial` overrides its rotary fraction."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    factor = float(partial if partial is not None else params.get("partial_rotary_factor",
                                                                  cfg.get("partial_rotary_factor") or 1.0))
    params.pop("partial_rotary_factor", None)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = _parse_rope({**cfg, "rope_parameters": params, "rope_scaling": None, "partial_rotary_factor": None})
    return rope, int(head_dim * factor)


# ---- loading ---------------------------------------------------------------------------------


def load_hybrid_from_dir(path: str | Path, config: dict, *, dtype: torch.dtype | None, device: torch.device,
                         extra_eos: tuple[int, ...], read: Callable[..., dict[str, torch.Tensor]],
                         backend: AttentionBackend | None = None) -> HybridDecoder:
    """`read(root, names, device=)` reads tensors by name (`loading.read_safetensors`)."""
    root = Path(path)
    spec = hybrid_spec_from_config(config, dtype=dtype, extra_eos_token_ids=extra_eos)
    # NOTE: Nemotron-H checkpoints keep NVIDIA's `backbone.` prefix, which HF renames to `model.` on load
    renamed = {_on_disk(n, root): n for n in spec.weight_shapes()}
    tensors = {renamed[n]: t for n, t in read(root, set(renamed), device=device).items()}
    if spec.tie_word_embeddings:
        tensors.pop(LM_HEAD, None)
    return HybridDecoder(spec, {n: t.to(spec.dtype) for n, t in tensors.items()}, backend=backend)


def _on_disk(name: str, root: Path) -> str:
    """The checkpoint's name for the engine's (HF module) tensor name."""
    if _uses_backbone_prefix(root) and name.startswith("model."):
        return "backbone." + name[len("model."):]
    return name


def _uses_backbone_prefix(root: Path) -> bool:
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.exists():
        keys = json.loads(index.read_text())["weight_map"]
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            return False
        with safe_open(str(files[0]), framework="pt") as f:
            keys = list(f.keys())
    return any(k.startswith("backbone.") for k in keys)


def load_hybrid_from_module(model: torch.nn.Module, *, share_weights: bool, dtype: torch.dtype,
                            device: torch.device, extra_eos: tuple[int, ...],
                            backend: AttentionBackend | None = None) -> HybridDecoder:
    spec = hybrid_spec_from_config(model.config, dtype=dtype, extra_eos_token_ids=extra_eos)
    params = dict(model.named_parameters(remove_duplicate=False))
    tensors, report = bind_module_tensors(type(model).__name__, params, spec.weight_shapes(), dtype, device,
                                          share_weights)
    decoder = HybridDecoder(spec, tensors, backend=backend)
    decoder.bind_report = report
    return decoder
