"""One LoRA adapter's tensors, read from a PEFT directory and checked against the model.

An adapter holds, per decoder layer, `module -> (A [r, in], B [out, r] * scaling)` for the modules
it adapts (`q_proj` ... `down_proj`): the scaling is folded into B once, so a step computes
`y += (x A^T) B^T` and nothing else. Projections that read the same input (q, k, v; gate, up)
keep their A stacked (`fused`): one GEMM `x A_cat^T` serves them all, then one small GEMM per B.

A *shared* adapter (`load_live_peft_adapter(..., share=True)`, colocated) instead aliases the
trainer's PEFT parameters: A and B are the trainer's tensors themselves (zero copy, like the base
weights' `share_weights`), so an in-place optimizer step is what the next forward reads. Nothing
may be folded, stacked or transposed into a copy: each projection keeps its own A, B^T is a view,
and the scaling multiplies `x A^T` at run time.
What the model can adapt comes from the model itself (`model.lora_targets()`: HF module path ->
(out, in)); a model without it refuses with its reason.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from inference.errors import LoRACapacityError, LoRALoadError, LoRAShapeError, LoRATargetError
from inference.lora.files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_files

_PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_LAYER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>\w+)$")


@dataclass(slots=True)
class LoRAAdapter:
    """An adapter ready to apply: `layers[i][proj] = (A, B_scaled)` in the engine's dtype and device
    (shared: `(A, B)`, the trainer's own tensors, and `scales[i][proj]` the scaling).

    Invariant: every A is `[rank_of_module, in]` and every B `[out, rank_of_module]` of the module it
    adapts, with `rank_of_module <= rank`; `nbytes` counts them all."""

    name: str
    rank: int
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    path: Optional[str] = None
    version: int = 0  # set by the registry when the adapter becomes resident
    modules: frozenset[str] = field(default_factory=frozenset)  # the projection names it adapts
    # shared: `layers` alias a live PEFT model's parameters, B unscaled; `scales[i][proj]` is the scaling
    shared: bool = False
    scales: list[dict[str, float]] = field(default_factory=list)
    # per layer: input group -> [(A [sum r, in], scale of x A^T, [(output j of the group, r0, r1, B [out, r],
    # B^T [r, out])])]: one entry whose A stacks the group's (scale 1, folded into B), or one per projection
    # (shared). B is `layers`' own tensor (the trainer's, shared): what a fixed-order product reads, packed once
    fused: list[dict[str, list[FusedA]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.shared:
            self.fused = [_alias(layer, scales) for layer, scales in zip(self.layers, self.scales, strict=True)]
        else:
            self.fused = [_fuse(layer) for layer in self.layers]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors a forward reads (a shared adapter's are the trainer's, not the engine's)."""
        return sum(a.nbytes + sum(bt.nbytes for *_, bt in parts)
                   for layer in self.fused for blocks in layer.values() for a, _, parts in blocks)

    def adapts(self, layer: int, projs: tuple[str, ...]) -> bool:
        own = self.layers[layer]
        return any(p in own for p in projs)


# projections that read one input, in the order the decoder passes their outputs
INPUT_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                "down": ("down_proj",)}
# every projection an adapter may adapt (PEFT's `target_modules` for "all linear layers" of a block)
LORA_PROJECTIONS = tuple(p for projs in INPUT_GROUPS.values() for p in projs)


FusedA = tuple[torch.Tensor, float, list[tuple[int, int, int, torch.Tensor, torch.Tensor]]]
ModuleConfig = Callable[[str], tuple[int, float]]  # an adapted module's HF path -> (rank, alpha) as configured


def _fuse(layer: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, list[FusedA]]:
    fused = {}
    for group, projs in INPUT_GROUPS.items():
        present = [(j, p) for j, p in enumerate(projs) if p in layer]
        if not present:
            continue
        a_cat = torch.cat([layer[p][0] for _, p in present]).contiguous()
        parts, r0 = [], 0
        for j, p in present:
            r = layer[p][0].shape[0]
            parts.append((j, r0, r0 + r, layer[p][1], layer[p][1].t().contiguous()))
            r0 += r
        fused[group] = [(a_cat, 1.0, parts)]
    return fused


def _alias(layer: dict[str, tuple[torch.Tensor, torch.Tensor]], scales: dict[str, float]) -> dict[str, list[FusedA]]:
    """The shared layout: views of the trainer's tensors only (NOTE: `B.t()` is a view; `mm` reads it
    transposed, so nothing is copied and the trainer's next in-place step shows through)."""
    fused = {}
    for group, projs in INPUT_GROUPS.items():
        blocks = [(layer[p][0], scales[p], [(j, 0, layer[p][0].shape[0], layer[p][1], layer[p][1].t())])
                  for j, p in enumerate(projs) if p in layer]
        if blocks:
            fused[group] = blocks
    return fused


def model_lora_targets(model: Any) -> dict[str, tuple[int, int]]:
    """The model's adaptable modules (HF module path -> (out, in)), or the typed refusal with its reason."""
    targets = getattr(model, "lora_targets", None)
    if targets is None:
        reason = getattr(model, "lora_refusal", f"{type(model).__name__} does not implement LoRA")
        raise LoRATargetError(f"this model cannot serve LoRA adapters: {reason}")
    return targets()


def _parse_config(data: bytes, path: str) -> Any:
    """`adapter_config.json`'s bytes as peft reads them (`PeftConfig.from_pretrained`'s steps, from
    bytes already read: see `files`), checked."""
    from peft import PeftConfig  # NOTE: imported here: only loading an adapter needs peft

    try:
        loaded = json.loads(data)
        if not isinstance(loaded, dict):
            raise ValueError("not a JSON object")
        loaded.pop("runtime_config", None)
        config = PeftConfig.from_peft_type(**PeftConfig.check_kwargs(**loaded))
    except Exception as exc:  # a malformed or unknown config: peft raises several types
        raise LoRALoadError(f"LoRA adapter {path!r}: unreadable {ADAPTER_CONFIG}: {exc}") from None
    return check_peft_config(config, path)


def check_peft_config(config: Any, path: str) -> Any:
    """`config` (a peft `PeftConfig`) if the engine computes what it describes, else the typed refusal."""
    from peft import PeftType

    if config.peft_type != PeftType.LORA:
        raise LoRALoadError(f"LoRA adapter {path!r}: peft_type is {config.peft_type}, not LORA")
    if getattr(config, "target_parameters", None):
        raise LoRATargetError(f"LoRA adapter {path!r}: target_parameters {list(config.target_parameters)[:4]} "
                              "(LoRA on fused parameters, e.g. MoE experts) are not adapted by the engine")
    refusals = {
        "use_dora": "DoRA (use_dora) is not computed by the engine",
        "modules_to_save": "modules_to_save (fully trained copies of modules) are not served",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layouts) is not supported",
        "lora_bias": "trained LoRA biases (lora_bias) are not supported",
    }
    for name, why in refusals.items():
        if getattr(config, name, None):
            raise LoRATargetError(f"LoRA adapter {path!r}: {why}")
    if getattr(config, "bias", "none") != "none":
        raise LoRATargetError(f"LoRA adapter {path!r}: bias={config.bias!r} (trained base biases) is not supported")
    return config


def load_peft_adapter(path: str, name: str, model: Any, *, max_rank: int, dtype: torch.dtype,
                      device: torch.device, where: Optional[Callable[[str], None]] = None) -> LoRAAdapter:
    """Read (`files.read_adapter_files`: regular files only, bounded; `where` checks the opened
    directory's real path) and check the PEFT adapter at `path` for `model`; typed `LoRAError`s,
    nothing kept on failure."""
    config_bytes, weights = read_adapter_files(path, where)
    config = _parse_config(config_bytes, path)
    from safetensors.torch import load

    try:
        tensors = load(weights)
    except Exception as exc:
        raise LoRALoadError(f"LoRA adapter {path!r}: unreadable {ADAPTER_WEIGHTS}: {exc}") from None
    return adapter_from_tensors(tensors, name, model, alpha=config.lora_alpha, rslora=bool(config.use_rslora),
                                max_rank=max_rank, dtype=dtype, device=device, path=path,
                                module_config=peft_module_config(config))


def load_live_peft_adapter(peft_model: Any, name: str, model: Any, *, max_rank: int, dtype: torch.dtype,
                           device: torch.device, adapter_name: str = "default", share: bool = False) -> LoRAAdapter:
    """The adapter `adapter_name` of a live PEFT model (a trainer's): its tensors copied as they are
    now (the sync of a trained adapter without a trip through disk), or with `share` aliased (the
    colocated trainer's own parameters, zero copy: they must already be in `dtype` on `device`,
    else `LoRALoadError`). Typed refusals as above."""
    from peft import get_peft_model_state_dict

    if adapter_name not in getattr(peft_model, "peft_config", {}):
        raise LoRALoadError(f"{type(peft_model).__name__} has no PEFT adapter {adapter_name!r}")
    config = check_peft_config(peft_model.peft_config[adapter_name], f"{name} (live)")
    # NOTE: state_dict tensors are detached views of the parameters (same storage), which `share` keeps
    with torch.no_grad():
        tensors = {k: v.detach() for k, v in get_peft_model_state_dict(peft_model, adapter_name=adapter_name).items()}
    if share:
        wrong = [k for k, t in tensors.items() if t.dtype != dtype or t.device != torch.device(device)]
        if wrong:
            t = tensors[wrong[0]]
            raise LoRALoadError(f"LoRA adapter {name!r} (live, share=True): {wrong[0]} is {t.dtype} on {t.device}, "
                                f"the engine computes in {dtype} on {device}; aliasing needs both equal (or load "
                                "it with share=False, which copies)")
    return adapter_from_tensors(tensors, name, model, alpha=config.lora_alpha, rslora=bool(config.use_rslora),
                                max_rank=max_rank, dtype=dtype, device=device, share=share,
                                module_config=peft_module_config(config))


def peft_module_config(config: Any) -> ModuleConfig:
    """Each module's (rank, alpha) as PEFT builds its layer: `rank_pattern` / `alpha_pattern` where
    a key names the module (PEFT's own matcher, `get_pattern_key`), else the config's `r` and
    `lora_alpha`."""
    from peft.utils.other import get_pattern_key

    ranks, alphas = dict(config.rank_pattern or {}), dict(config.alpha_pattern or {})

    def of(module: str) -> tuple[int, float]:
        r = ranks.get(get_pattern_key(list(ranks), module), config.r)
        return int(r), float(alphas.get(get_pattern_key(list(alphas), module), config.lora_alpha))
    return of


@dataclass(frozen=True, slots=True)
class AdapterShape:
    """What `check_adapter_shapes` found: per adapted module (HF path) the keys of its A and B, the
    largest rank, the projection names adapted, and the model's layer count."""

    keys: dict[str, tuple[str, str]]
    rank: int
    modules: frozenset[str]
    num_layers: int


def check_adapter_shapes(shapes: dict[str, tuple[int, ...]], name: str, model: Any, *, max_rank: int,
                         path: Optional[str] = None) -> AdapterShape:
    """Every check of PEFT-named adapter tensors that needs only their names and shapes (targets,
    A / B pairs and shapes against the model's projections, rank): typed `LoRAError`s. No tensor is
    touched, so a sync runs it on a manifest before a byte arrives."""
    targets = model_lora_targets(model)
    where = path or name
    pairs: dict[str, dict[str, str]] = {}
    for key in shapes:
        m = _KEY.match(key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key)
        if m is None:
            raise LoRATargetError(f"LoRA adapter {where!r}: tensor {key!r} is not a LoRA A/B weight "
                                  "(embeddings, DoRA magnitudes and biases are not served)")
        pairs.setdefault(m["module"], {})[m["ab"]] = key
    if not pairs:
        raise LoRALoadError(f"LoRA adapter {where!r} holds no LoRA tensors")
    unknown = sorted(set(pairs) - set(targets))
    if unknown:
        limits = getattr(model, "lora_limits", "")
        raise LoRATargetError(f"LoRA adapter {where!r} targets modules this model cannot adapt: {unknown[:4]} "
                              f"(adaptable: {sorted({p.rsplit('.', 1)[-1] for p in targets})}){limits}")
    rank, projs, keys = 0, set(), {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAShapeError(f"LoRA adapter {where!r}: {module} has lora_{''.join(ab)} only")
        a, b = tuple(shapes[ab["A"]]), tuple(shapes[ab["B"]])
        out_f, in_f = targets[module]
        r = a[0] if a else 0
        if len(a) != 2 or len(b) != 2 or a[1] != in_f or b != (out_f, r):
            raise LoRAShapeError(f"LoRA adapter {where!r}: {module} has A {a} and B {b}; "
                                 f"the model's projection is [{out_f}, {in_f}], so A must be [r, {in_f}] "
                                 f"and B [{out_f}, r]")
        if r > max_rank:
            raise LoRACapacityError(f"LoRA adapter {where!r}: rank {r} of {module} exceeds max_lora_rank={max_rank}")
        keys[module] = (ab["A"], ab["B"])
        rank, projs = max(rank, r), projs | {_LAYER.match(module)["proj"]}
    num_layers = 1 + max(int(_LAYER.match(p)["layer"]) for p in targets)
    return AdapterShape(keys, rank, frozenset(projs), num_layers)


def adapter_from_tensors(tensors: dict[str, torch.Tensor], name: str, model: Any, *, alpha: float, rslora: bool,
                         max_rank: int, dtype: torch.dtype, device: torch.device,
                         path: Optional[str] = None, share: bool = False,
                         module_config: Optional[ModuleConfig] = None) -> LoRAAdapter:
    """An adapter from PEFT-named tensors (`base_model.model.<module>.lora_{A,B}.weight`), checked;
    `share`: the tensors themselves, unscaled (their caller checked dtype and device).

    `module_config` (a PEFT config's, `peft_module_config`): each module's rank as its config
    states it, which its tensors must have (`LoRAShapeError` naming both), and its alpha; the
    scaling is then PEFT's, `alpha / r` (rsLoRA: `alpha / sqrt(r)`). Without it (a sync, which
    sends the tensors and one alpha), the tensors' rank and `alpha`."""
    shape = check_adapter_shapes({k: tuple(t.shape) for k, t in tensors.items()}, name, model, max_rank=max_rank,
                                 path=path)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(shape.num_layers)]
    scales: list[dict[str, float]] = [{} for _ in range(shape.num_layers)]
    for module, (ka, kb) in shape.keys.items():
        a, b = tensors[ka], tensors[kb]
        r, module_alpha = (a.shape[0], alpha) if module_config is None else module_config(module)
        if r != a.shape[0]:
            raise LoRAShapeError(f"LoRA adapter {path or name!r}: {module} has rank {a.shape[0]} in its tensors "
                                 f"but rank {r} in its {ADAPTER_CONFIG} (r, or the rank_pattern entry naming it)")
        scaling = module_alpha / (math.sqrt(r) if rslora else r)
        m = _LAYER.match(module)
        i, proj = int(m["layer"]), m["proj"]
        if share:
            layers[i][proj], scales[i][proj] = (a, b), scaling
        else:
            # NOTE: copy=True: a copy owns its bytes (a live PEFT model's A in the engine's dtype would
            # be aliased by a plain `.to`, and the trainer's next step would then leak into this version)
            layers[i][proj] = (a.to(device, dtype, copy=True).contiguous(),
                               (b.to(device, torch.float32) * scaling).to(dtype).contiguous())
    return LoRAAdapter(name, shape.rank, layers, path=path, modules=shape.modules, shared=share,
                       scales=scales if share else [])
