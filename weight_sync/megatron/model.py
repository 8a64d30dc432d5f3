"""A live megatron-core GPTModel as the engine's HF-named tensors, aliased where layouts allow.

`bind_megatron_model(model)` returns a `MegatronBinding`: a read-only mapping HF name -> tensor
that a `DenseDecoder` can hold as its weights. Which names alias and which copy:

* aliased (views of megatron's parameters, no bytes moved): the embedding, every norm, `o_proj`
  (`linear_proj`), `down_proj` (`linear_fc2`), the LM head (`output_layer`), gate and up (the
  two row halves of `linear_fc1`), biases likewise, and q / k / v when the model has one
  query group.
* copied (converted, and logged as a warning): q / k / v (weights and biases) with several query
  groups, whose rows are interleaved by group in `linear_qkv`; and any tensor whose dtype or
  device differs from the engine's.

In-place optimizer steps show through the aliases at once. The copies are rewritten in place by
`refresh()`, the "fast layout conversion" (one strided copy per tensor, no allocation), so an
engine holding them sees new values without a rebind: call it after each optimizer step.
Replacing a parameter (`param.data = ...`, e.g. by a DDP wrapper built later) breaks aliases:
bind after wrapping, and again after such a change.

`MEGATRON_ADAPTER` is the engine's `WeightAdapter` for megatron-core, passed where it is used:
`engine.bind_trainer_model(gpt_model, adapter=MEGATRON_ADAPTER)`,
`engine.update_weights(megatron_named_tensors, adapter=MEGATRON_ADAPTER)` (a `WeightReceiver` passes
it for a manifest of megatron-core names). Importing this module registers nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from typing import Any

import torch

from inference.models.dense.decoder import alias_blocker
from inference.models.layers import rope_inv_freq
from inference.models.spec import ModelSpec, RopeKind
from inference.weights.adapters import WeightAdapter
from weight_sync.megatron.names import (
    FusedLayout,
    megatron_to_hf,
    spec_from_megatron_config,
    strided_parts,
    validate_megatron,
)

logger = logging.getLogger(__name__)


# ModelSpec fields that change the maths (not dtype, family or serving limits)
_COMPUTE_FIELDS = tuple(
    f.name
    for f in fields(ModelSpec)
    if f.name not in ("family", "dtype", "eos_token_ids", "max_position_embeddings", "sliding_window")
)


def unwrap(module: Any) -> Any:
    """The GPTModel inside megatron's wrappers (DDP, Float16Module hold it as `.module`)."""
    while not hasattr(module, "decoder") and hasattr(module, "module"):
        module = module.module
    return module


def is_gpt_model(module: Any) -> bool:
    """Whether `module` (or what it wraps) is a megatron-core GPTModel; megatron is not imported."""
    m = unwrap(module)
    return hasattr(m, "decoder") and hasattr(m, "config") and hasattr(m.config, "num_query_groups")


def spec_from_gpt_model(model: Any, *, dtype: torch.dtype | None = None, rope_scaling_factor: float = 8.0) -> ModelSpec:
    """The engine's `ModelSpec` for a GPTModel, its RoPE checked against the module's own.

    NOTE: GPTModel does not keep llama3 scaling's factor; pass it when it is not megatron's 8.
    """
    m = unwrap(model)
    rotary = getattr(m, "rotary_pos_emb", None)
    spec = spec_from_megatron_config(
        m.config,
        vocab_size=m.vocab_size,
        max_position_embeddings=m.max_sequence_length,
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
        rope_scaling=bool(m.rotary_scaling),
        rope_scaling_factor=rope_scaling_factor,
        seq_len_interpolation_factor=getattr(rotary, "seq_len_interpolation_factor", None),
        position_embedding_type=m.position_embedding_type,
        tie_word_embeddings=m.share_embeddings_and_output_weights,
        dtype=dtype or m.config.params_dtype,
    )
    if rotary is not None:
        # GPTModel.rotary_base echoes its argument; the frequencies are what the forward uses
        ours = rope_inv_freq(spec.rope, spec.head_dim)
        if spec.rope.kind is RopeKind.LINEAR:  # megatron divides positions, not frequencies
            ours = ours * spec.rope.factor
        theirs = rotary.inv_freq.detach().to("cpu", torch.float32)
        if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=1e-5, atol=0):
            raise ValueError(f"spec_from_gpt_model: RoPE {spec.rope} does not reproduce the module's inv_freq")
    return spec


class MegatronBinding(Mapping[str, torch.Tensor]):
    """HF name -> tensor over a GPTModel's parameters (a read-only mapping).

    Invariant: each name in `aliased` is a view of a megatron parameter (shares its storage);
    each name in `copied` (name -> reason) is a converted copy that `refresh()` rewrites in place
    from the parameter's current values. A tied model has no `lm_head.weight`.
    """

    __slots__ = ("_tensors", "_refreshers", "aliased", "copied")

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._refreshers: list[Callable[[], None]] = []
        self.aliased: list[str] = []
        self.copied: dict[str, str] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @torch.no_grad()
    def refresh(self) -> list[str]:
        """Rewrite every copy from the current parameters, in place; returns the names rewritten."""
        for refresh in self._refreshers:
            refresh()
        return list(self.copied)


def bind_megatron_model(
    model: Any,
    spec: ModelSpec | None = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> MegatronBinding:
    """HF-named views (or, where they cannot be, copies) of a GPTModel's parameters.

    `spec` is the engine's; it must agree with the module's own in everything but dtype (a
    ValueError names the field). dtype / device default to the spec's and the parameters'.
    """
    own = spec_from_gpt_model(model, dtype=spec.dtype if spec is not None else dtype)
    if spec is not None:
        diff = [f for f in _COMPUTE_FIELDS if getattr(spec, f) != getattr(own, f)]
        if diff:
            raise ValueError(f"bind_megatron_model: the engine's spec and the module's differ in {diff}")
    return bind_megatron_tensors(dict(unwrap(model).named_parameters()), spec or own, dtype=dtype, device=device)


def bind_megatron_tensors(
    params: Mapping[str, torch.Tensor],
    spec: ModelSpec,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> MegatronBinding:
    """`bind_megatron_model` over megatron-named tensors (all of them; names and shapes checked).

    dtype / device default to the spec's and the first tensor's.
    """
    resolved = validate_megatron(params, spec, complete=True)
    dtype = dtype or spec.dtype
    device = torch.device(device) if device is not None else params[next(iter(resolved))].device
    hf_shapes = spec.weight_shapes()
    binding = MegatronBinding()
    for name, t in resolved.items():
        param = params[name]
        parts = strided_parts(param.detach(), t.layout, spec)
        for index, (hf_name, part) in enumerate(zip(t.hf_names, parts)):
            if hf_name not in hf_shapes:
                continue  # a tied model's output layer
            shape = hf_shapes[hf_name]
            reason = alias_blocker(param, dtype, device)
            if reason is None:
                try:
                    binding._tensors[hf_name] = part.view(shape)
                    binding.aliased.append(hf_name)
                    continue
                except RuntimeError:
                    reason = (
                        f"{name} interleaves q/k/v by query group ({spec.num_kv_heads} groups): not one strided block"
                    )
            copy = torch.empty(shape, dtype=dtype, device=device)
            binding._tensors[hf_name] = copy
            binding.copied[hf_name] = reason
            binding._refreshers.append(_refresher(copy, param, t.layout, index, spec))
    binding.refresh()
    if binding.copied:
        sample = "; ".join(f"{n}: {r}" for n, r in list(binding.copied.items())[:3])
        logger.warning(
            "megatron binding: %d of %d tensors are COPIES, not aliases (call refresh() after each "
            "optimizer step, or the engine keeps their old values): %s",
            len(binding.copied),
            len(binding),
            sample,
        )
    return binding


def _refresher(dst: torch.Tensor, param: torch.Tensor, layout: FusedLayout, index: int, spec: ModelSpec):
    def refresh() -> None:
        # NOTE: re-selected from the parameter on each call, so a replaced `param.data` is followed
        src = strided_parts(param.detach(), layout, spec)[index]
        dst.view(src.shape).copy_(src)

    return refresh


def _names_to_hf(named: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    return megatron_to_hf(named, spec, complete=False)


MEGATRON_ADAPTER = WeightAdapter(
    name="megatron-core",
    module_to_hf=lambda module, spec: bind_megatron_model(module, spec),
    names_to_hf=_names_to_hf,
)
