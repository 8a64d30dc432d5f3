"""MoE families' weights into a `MoeDecoder`: from a directory or a live `*ForCausalLM`, taking
only this expert-parallel rank's experts (names: `names.py`).

A directory is read lazily by name, so a rank reads (and keeps) only its own experts when the
checkpoint names them one by one (what `save_pretrained` writes); a fused checkpoint is sliced and
the rest freed. From a live module, `share_weights` makes the engine's tensors the module's own
(this rank's experts as views of the trainer's fused tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from inference.attention.base import AttentionBackend
from inference.models.dense.decoder import LM_HEAD, bind_module_tensors
from inference.models.moe.decoder import MoeDecoder
from inference.models.moe.names import disk_names, disk_sources, localize_expert_tensors
from inference.models.moe.spec import MoeSpec


def load_moe_from_dir(path: str | Path, config: dict, *, dtype: Optional[torch.dtype], device: torch.device,
                      extra_eos: tuple[int, ...], read: Callable[..., dict[str, torch.Tensor]],
                      backend: Optional[AttentionBackend] = None, expert_parallel: Any = None):
    """`read(root, names, device=)` reads tensors by name (`loading.read_safetensors`)."""
    root = Path(path)
    spec = _spec(config, dtype, extra_eos, expert_parallel)
    raw = read(root, disk_sources(spec, disk_names(root)), device=device)
    tensors = localize_expert_tensors(spec, raw)
    tensors.pop(LM_HEAD, None) if spec.tie_word_embeddings else None
    # NOTE: a fused checkpoint's slice is a view of every expert: a copy lets the rest be freed
    local = {n: (t.clone() if n in spec.expert_names() and t.untyped_storage().nbytes() > t.nbytes else t)
             for n, t in tensors.items()}
    return MoeDecoder(spec, {n: t.to(spec.dtype) for n, t in local.items()}, backend=backend,
                      expert_parallel=expert_parallel)


def load_moe_from_module(model: torch.nn.Module, *, share_weights: bool, dtype: torch.dtype, device: torch.device,
                         extra_eos: tuple[int, ...], backend: Optional[AttentionBackend] = None,
                         expert_parallel: Any = None):
    """Build from a live `Qwen3MoeForCausalLM` / `Qwen2MoeForCausalLM` / `MixtralForCausalLM`;
    with `share_weights` the engine's tensors are the module's (this rank's experts as views)."""
    spec = _spec(model.config, dtype, extra_eos, expert_parallel)
    params = localize_expert_tensors(spec, dict(model.named_parameters(remove_duplicate=False)))
    tensors, report = bind_module_tensors(type(model).__name__, params, spec.weight_shapes(), dtype, device,
                                          share_weights)
    decoder = MoeDecoder(spec, tensors, backend=backend, expert_parallel=expert_parallel)
    decoder.bind_report = report
    return decoder


def _spec(config: Any, dtype: Optional[torch.dtype], extra_eos: tuple[int, ...], expert_parallel: Any) -> MoeSpec:
    spec = MoeSpec.from_hf_config(config, dtype=dtype, extra_eos_token_ids=extra_eos)
    if expert_parallel is None:
        return spec
    if expert_parallel.num_experts != spec.num_experts:
        raise ValueError(f"expert_parallel splits {expert_parallel.num_experts} experts; the model has "
                         f"{spec.num_experts}")
    return spec.with_expert_parallel(expert_parallel.world_size, expert_parallel.rank)
