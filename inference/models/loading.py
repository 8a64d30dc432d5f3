"""Build a `DenseDecoder` from an HF model directory or from an in-memory HF model.

* `load_from_hf_dir(path)`: `config.json` (+ `generation_config.json` for extra EOS ids) and
  `*.safetensors`, sharded (`model.safetensors.index.json`) or not. Only needs `safetensors`,
  not `transformers`.
* `load_from_hf_model(model, share_weights=True)`: the engine's tensors *are* the module's
  parameters (same storage, checked by `data_ptr()`), so an optimizer step is visible to the
  engine at once. Aliasing survives in-place updates (`optimizer.step()`, `param.copy_()`), not
  rebinding (`param.data = ...`, `model.to(...)`): call `DenseDecoder.bind_weights` again after
  those. A parameter whose dtype/device/type differs from the engine's is copied instead, with
  a warning naming it; in the Llama family HF's layout (separate q/k/v and gate/up projections,
  tied embeddings as one tensor) is the engine's, so layout itself never forces a copy.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from inference.attention.base import AttentionBackend
from inference.models.dense.decoder import EMBED, LM_HEAD, DenseDecoder, bind_module_tensors
from inference.models.hybrid.decoder import HybridDecoder
from inference.models.hybrid.loading import is_hybrid_config, load_hybrid_from_dir, load_hybrid_from_module
from inference.models.moe.decoder import MoeDecoder
from inference.models.moe.loading import load_moe_from_dir, load_moe_from_module
from inference.models.moe.spec import is_moe_config
from inference.models.spec import ModelSpec

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"


def load_from_hf_dir(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
    expert_parallel: Any = None,
) -> DenseDecoder | HybridDecoder | MoeDecoder:
    """Load a decoder saved by `save_pretrained` (dtype defaults to the config's, else fp32); a
    hybrid family's config (Bamba, Nemotron-H, Falcon-H1) gives a `HybridDecoder`, an MoE family's
    (Qwen3-MoE, Qwen2-MoE, Mixtral) a `MoeDecoder` (with `expert_parallel`: this rank's experts)."""
    root = Path(path)
    config = json.loads((root / "config.json").read_text())
    if is_moe_config(config):
        return load_moe_from_dir(root, config, dtype=dtype, device=_normalize_device(device),
                                 extra_eos=_generation_eos(root), read=read_safetensors, backend=backend,
                                 expert_parallel=expert_parallel)
    _no_experts(expert_parallel, config.get("model_type"))
    if is_hybrid_config(config):
        return load_hybrid_from_dir(root, config, dtype=dtype, device=_normalize_device(device),
                                    extra_eos=_generation_eos(root), read=read_safetensors, backend=backend)
    spec = ModelSpec.from_hf_config(config, dtype=dtype, extra_eos_token_ids=_generation_eos(root))
    device = _normalize_device(device)
    tensors = read_safetensors(root, set(spec.weight_shapes()), device=device)
    if spec.tie_word_embeddings:
        tensors.pop(LM_HEAD, None)
    tensors = {n: t.to(spec.dtype) for n, t in tensors.items()}
    return DenseDecoder(spec, tensors, backend=backend)


def read_safetensors(root: Path, names: Optional[set[str]], *, device: torch.device | str = "cpu"
                     ) -> dict[str, torch.Tensor]:
    """Read `names` (None: every tensor) from the directory's safetensors files (others are
    skipped, not loaded); sharded checkpoints are read through their index."""
    from safetensors import safe_open  # lazy: only this path needs the package

    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    index = root / _INDEX_FILE
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {root}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(root / file), framework="pt", device=str(device)) as f:
            for key in f.keys():
                if names is None or key in names:
                    out[key] = f.get_tensor(key)
    if names is None:
        return out
    missing = names - set(out) - {LM_HEAD}
    if missing:
        raise KeyError(f"{root}: checkpoint lacks {sorted(missing)[:8]}")
    return out


def load_from_hf_model(
    model: torch.nn.Module,
    *,
    share_weights: bool = False,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    backend: AttentionBackend | None = None,
    expert_parallel: Any = None,
) -> DenseDecoder | HybridDecoder | MoeDecoder:
    """Build from a transformers `*ForCausalLM`; dtype/device default to the model's own.

    With `share_weights`, every tensor that can be aliased is (see module docstring); the
    returned model's `bind_report` says which were aliased and which copied, and why.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    params = dict(model.named_parameters(remove_duplicate=False))
    if is_moe_config(config):
        first = params[EMBED]
        return load_moe_from_module(model, share_weights=share_weights, dtype=dtype or first.dtype,
                                    device=_normalize_device(device if device is not None else first.device),
                                    extra_eos=_module_generation_eos(model), backend=backend,
                                    expert_parallel=expert_parallel)
    _no_experts(expert_parallel, getattr(config, "model_type", None))
    if EMBED not in params and not is_hybrid_config(config):
        raise TypeError(f"{type(model).__name__} has no {EMBED}: pass the *ForCausalLM model")
    if is_hybrid_config(config):
        first = next(iter(params.values()))
        return load_hybrid_from_module(model, share_weights=share_weights, dtype=dtype or first.dtype,
                                       device=_normalize_device(device if device is not None else first.device),
                                       extra_eos=_module_generation_eos(model), backend=backend)
    first = params[EMBED]
    dtype = dtype or first.dtype
    device = _normalize_device(device if device is not None else first.device)
    spec = ModelSpec.from_hf_config(config, dtype=dtype, extra_eos_token_ids=_module_generation_eos(model))
    if spec.tie_word_embeddings and LM_HEAD in params and params[LM_HEAD] is not first:
        logger.warning(
            "config says tie_word_embeddings but lm_head.weight is a separate tensor; "
            "the engine uses the embedding as its LM head"
        )
    tensors, report = bind_module_tensors(type(model).__name__, params, spec.weight_shapes(), dtype, device,
                                          share_weights)
    decoder = DenseDecoder(spec, tensors, backend=backend)
    decoder.bind_report = report
    return decoder


def _no_experts(expert_parallel: Any, model_type: Any) -> None:
    if expert_parallel is not None:
        raise ValueError(f"expert_parallel is for MoE models; model_type {model_type!r} has no experts")


def _normalize_device(device: torch.device | str) -> torch.device:
    # "cuda" and "cuda:0" are one device, but compare unequal: give the index explicitly so that
    # aliasing is not refused over spelling
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _generation_eos(root: Path) -> tuple[int, ...]:
    gen = root / "generation_config.json"
    if not gen.exists():
        return ()
    return _as_ids(json.loads(gen.read_text()).get("eos_token_id"))


def _module_generation_eos(model: Any) -> tuple[int, ...]:
    gen = getattr(model, "generation_config", None)
    return _as_ids(getattr(gen, "eos_token_id", None)) if gen is not None else ()


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)
