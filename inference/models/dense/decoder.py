"""The dense decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

The model is functional over a name -> tensor mapping with Hugging Face names, so that it can
hold a trainer's parameters themselves (aliasing) or its own copies, and a weight update is a
rebind or an in-place copy by name (`bind_weights`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F

from inference.attention.base import AttentionBackend
from inference.attention.metadata import AttentionMetadata
from inference.attention.selector import select_backend
from inference.cache.kv_buffer import KVCacheBuffer
from inference.cache.specs import KVCacheSpec
from inference.lora.batch import MLP_PROJS, LoRABatch, LoRAGroups
from inference.models.dense import native_layers
from inference.models.layers import RotaryEmbedding, add_rms_norm_, apply_rotary_, lm_head, rms_norm, swiglu
from inference.models.small_gemm import linear, linear_group
from inference.models.spec import ModelSpec

logger = logging.getLogger(__name__)

# attribute of `LayerTensors` -> HF name suffix under `model.layers.{i}.`
_LAYER_FIELDS = {
    "in_norm": "input_layernorm.weight",
    "q_w": "self_attn.q_proj.weight",
    "q_b": "self_attn.q_proj.bias",
    "k_w": "self_attn.k_proj.weight",
    "k_b": "self_attn.k_proj.bias",
    "v_w": "self_attn.v_proj.weight",
    "v_b": "self_attn.v_proj.bias",
    "o_w": "self_attn.o_proj.weight",
    "o_b": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate_w": "mlp.gate_proj.weight",
    "gate_b": "mlp.gate_proj.bias",
    "up_w": "mlp.up_proj.weight",
    "up_b": "mlp.up_proj.bias",
    "down_w": "mlp.down_proj.weight",
    "down_b": "mlp.down_proj.bias",
}
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
# the projections a LoRA adapter may adapt, by HF module name under `model.layers.{i}.`
LORA_MODULES = tuple(f"{part}.{proj}" for part, projs in
                     (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", MLP_PROJS)) for proj in projs)


# what a subclass may override that `native_layers.run` computes as `DenseDecoder` does
_BLOCK_PIECES = ("attention_inputs", "after_attention", "mlp", "embed", "rope", "trim_last_layer")


@cache
def _dense_blocks(cls: type) -> bool:
    """Whether `cls` runs `DenseDecoder`'s own blocks (what `native_layers.run` computes)."""
    return all(getattr(cls, name) is getattr(DenseDecoder, name) for name in _BLOCK_PIECES)


class LayerTensors:
    """One block's tensors, resolved once per (re)bind so the forward does no dict lookups (the decoder's,
    and its training forward's over the trainer's parameters: `inference.models.dense.training`)."""

    __slots__ = tuple(_LAYER_FIELDS)

    def __init__(self, tensors: Mapping[str, torch.Tensor], index: int) -> None:
        prefix = f"model.layers.{index}."
        for attr, suffix in _LAYER_FIELDS.items():
            setattr(self, attr, tensors.get(prefix + suffix))


@dataclass(slots=True)
class BindReport:
    """What `bind_weights` did: names now aliasing the source, and copied names with the reason."""

    aliased: list[str] = field(default_factory=list)
    copied: dict[str, str] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


def alias_or_copy(
    name: str,
    src: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    report: BindReport,
    blocker: str | None = None,
) -> torch.Tensor:
    """`src` itself when it can be aliased, else a converted copy; `report` records which and why."""
    reason = blocker or alias_blocker(src, dtype, device)
    if reason is None:
        report.aliased.append(name)
        return src.detach()  # same storage: no copy
    report.copied[name] = reason
    return src.detach().to(device, dtype, copy=True)


def bind_module_tensors(module_name: str, params: dict[str, torch.Tensor], expected, dtype: torch.dtype,
                        device: torch.device, share_weights: bool) -> tuple[dict[str, torch.Tensor], BindReport]:
    """The `expected` names of a live module's `params`, each aliased (with `share_weights`, where
    it can be) or copied; refuses a module that lacks any of them."""
    missing = sorted(set(expected) - set(params))
    if missing:
        raise KeyError(f"{module_name} lacks parameters {missing[:8]}")
    report = BindReport()
    blocker = None if share_weights else "share_weights=False"
    tensors = {name: alias_or_copy(name, params[name], dtype, device, report, blocker) for name in expected}
    if share_weights:
        warn_if_copied("share_weights=True", report, len(expected))
    return tensors, report


def warn_if_copied(what: str, report: BindReport, total: int) -> None:
    """Say loudly when tensors meant to alias a trainer's had to be copied."""
    if report.copied:
        sample = "; ".join(f"{n}: {r}" for n, r in list(report.copied.items())[:4])
        logger.warning("%s: %d of %d tensors could not be aliased and were COPIED (trainer updates to them "
                       "will not be seen): %s", what, len(report.copied), total, sample)


def alias_blocker(src: torch.Tensor, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `src` cannot be used as the engine's tensor as is, or None when it can."""
    if type(src.data) is not torch.Tensor:
        return f"tensor subclass {type(src.data).__name__} (sharded/quantised) is not a plain tensor"
    if src.layout is not torch.strided:
        return f"layout {src.layout} is not strided"
    if src.device.type == "meta":
        return "tensor is on the meta device (not materialised)"
    if src.dtype != dtype:
        return f"dtype {src.dtype} != engine dtype {dtype}"
    if src.device != device:
        return f"device {src.device} != engine device {device}"
    return None


class DenseDecoder:
    """Llama-family decoder: `model(input_ids, positions, kv_cache, meta, logits_indices) -> logits`.

    Invariants: `named_tensors()` holds exactly `spec.weight_shapes()` (HF names, shapes, the
    spec's dtype, one device); with tied embeddings the LM head *is* the embedding tensor. The
    forward never modifies a weight, so aliased trainer parameters are only read.
    """

    def __init__(
        self,
        spec: ModelSpec,
        tensors: Mapping[str, torch.Tensor],
        *,
        backend: AttentionBackend | None = None,
    ) -> None:
        self.spec = spec
        expected = spec.weight_shapes()
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise KeyError(f"DenseDecoder: missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}")
        self.device = tensors[EMBED].device
        self._tensors: dict[str, torch.Tensor] = {}
        for name, shape in expected.items():
            t = tensors[name]
            self._check(name, t, shape)
            if t.dtype != spec.dtype or t.device != self.device:
                raise ValueError(
                    f"DenseDecoder: {name} is {t.dtype} on {t.device}, expected {spec.dtype} on {self.device}"
                )
            self._tensors[name] = t.detach()
        self.bind_report: BindReport | None = None  # set by the loaders and by bind_weights
        self.rotary = RotaryEmbedding(spec.rope, spec.head_dim, self.device)
        self.backend = backend or select_backend(
            spec.num_heads, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype, device=self.device
        )
        self._resolve()

    # -- weights ---------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's tensors by HF name (a fresh dict; the tensors themselves, not copies)."""
        return dict(self._tensors)

    def bind_weights(self, tensors: Mapping[str, torch.Tensor], *, alias: bool) -> BindReport:
        """Take new weights by HF name; a subset of names is fine (bucketed updates).

        alias=True makes the engine hold the given tensors themselves (no copy) wherever their
        dtype/device/type allow, else a converted copy, logged with the reason. alias=False copies
        in place into the engine's current tensors (which, if aliased, are the trainer's).
        Every name and shape is checked before anything changes; `lm_head.weight` of a tied
        model is ignored (the LM head is the embedding).
        """
        expected = self.spec.weight_shapes()
        report = BindReport()
        todo: list[tuple[str, torch.Tensor]] = []
        for name, src in tensors.items():
            if name == LM_HEAD and self.spec.tie_word_embeddings:
                report.ignored.append(name)
                continue
            if name not in expected:
                raise KeyError(f"bind_weights: unknown tensor name {name!r}")
            self._check(name, src, expected[name])
            todo.append((name, src))
        with torch.no_grad():
            for name, src in todo:
                if not alias:
                    self._tensors[name].copy_(src)
                    report.copied[name] = "copy requested"
                    continue
                self._tensors[name] = alias_or_copy(name, src, self.dtype, self.device, report)
        if alias:
            warn_if_copied("bind_weights", report, len(todo))
        self._resolve()
        self.bind_report = report
        return report

    def _check(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} != expected {shape}")

    def _resolve(self) -> None:
        t = self._tensors
        self._embed = t[EMBED]
        self._final_norm = t[FINAL_NORM]
        self._lm_head = t[EMBED] if self.spec.tie_word_embeddings else t[LM_HEAD]
        self._layers = [LayerTensors(t, i) for i in range(self.spec.num_layers)]

    def lora_targets(self) -> dict[str, tuple[int, int]]:
        """The modules a LoRA adapter may adapt: HF module path -> (out, in) of its weight."""
        shapes = self.spec.weight_shapes()
        return {f"model.layers.{i}.{m}": shapes[f"model.layers.{i}.{m}.weight"]
                for i in range(self.spec.num_layers) for m in LORA_MODULES
                if f"model.layers.{i}.{m}.weight" in shapes}

    def weights_signature(self) -> tuple[int, ...]:
        """Where the weights live: unchanged by in-place updates, changed by a rebind (a captured
        CUDA graph reads weights at their addresses, so a rebind must re-capture it)."""
        return tuple(t.data_ptr() for t in self._tensors.values())

    # -- cache -----------------------------------------------------------------------------------

    def cache_specs(self) -> list[KVCacheSpec]:
        """One paged KV cache for all layers; a dense decoder keeps no per-request state."""
        s = self.spec
        return [KVCacheSpec(s.num_layers, s.num_kv_heads, s.head_dim, s.dtype)]

    def new_kv_cache(self, num_blocks: int, block_size: int, *, allocate: bool = True) -> KVCacheBuffer:
        s = self.spec
        return KVCacheBuffer(
            s.num_layers, num_blocks, block_size, s.num_kv_heads, s.head_dim, s.dtype, self.device, allocate=allocate
        )

    # -- forward ---------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCacheBuffer,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        *,
        states: None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Logits `[R, vocab]` (model dtype) for the flat-batch rows `logits_indices`.

        Writes this step's K/V of every layer into `kv_cache` at `meta.slot_mapping`. A dense
        decoder keeps no per-request state (`states` is for models that declare a state pool).
        `lora`: the step's adapters by row (None: every row runs the base model).
        """
        return self.decode_layers(self.embed(input_ids), positions, kv_cache, meta, logits_indices, lora)

    @torch.no_grad()
    def decode_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCacheBuffer,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """The decoder blocks, final norm and LM head over embedded tokens `x [T, hidden]`.

        The same pieces (`rope`, `attention_inputs`, `after_attention`, `head`) are what CUDA
        graphs capture between the attention calls (`inference/runner/cuda_graphs.py`).
        """
        self.check_sequence_lengths(meta)
        self.backend.plan(meta, kv_cache)
        cos, sin = self.rope(positions)
        if lora is None and _dense_blocks(type(self)):
            # NOTE: bf16 on the CPU: the same blocks in one native call where every piece takes its kernel
            out = native_layers.run(self, x, cos, sin, kv_cache, logits_indices)
            if out is not None:
                return self.head(out)
        last = len(self._layers) - 1
        trim = self.trim_last_layer
        groups = None if lora is None else lora.tokens
        for i in range(len(self._layers)):
            q, k, v = self.attention_inputs(i, x, cos, sin, groups)
            o = self.backend.forward(i, q, k, v, kv_cache)
            if i == last and trim:
                # NOTE: past the last attention everything is row-wise, so only sampled rows go on
                o = o.index_select(0, logits_indices)
                x = x.index_select(0, logits_indices)
                groups = None if lora is None else lora.sampled
            x = self.after_attention(i, x, o, groups)
        return self.head(x if trim else x.index_select(0, logits_indices))

    # -- the pieces of a step, between attention calls -------------------------------------------

    # whether the last block runs only on the rows whose logits are wanted (a subclass may need all)
    trim_last_layer = True

    def check_sequence_lengths(self, meta: AttentionMetadata) -> None:
        s = self.spec
        if s.sliding_window is not None and meta.max_seq_len > s.sliding_window:
            raise NotImplementedError(
                f"sliding-window attention is not implemented: a sequence of {meta.max_seq_len} tokens "
                f"exceeds the model's window of {s.sliding_window} (shorter sequences are exact)"
            )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self._embed)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary.cos_sin(positions, self.spec.dtype)

    def attention_inputs(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         lora: LoRAGroups | None = None):
        """Block `i`'s q, k, v (RoPE applied) from its input `x [T, hidden]`."""
        s, w = self.spec, self._layers[i]
        n_tok, eps = x.shape[0], s.rms_norm_eps
        h = rms_norm(x, w.in_norm, eps)
        # NOTE: bf16 on CPU, q, k and v in one call (views of one output), unless q and k are normed
        qkv = None if lora is not None or w.q_norm is not None else linear_group(
            h, (w.q_w, w.k_w, w.v_w), (w.q_b, w.k_b, w.v_b))
        if qkv is not None:
            q, k, v = qkv.split((w.q_w.shape[0], w.k_w.shape[0], w.v_w.shape[0]), dim=-1)
        else:
            q, k, v = linear(h, w.q_w, w.q_b), linear(h, w.k_w, w.k_b), linear(h, w.v_w, w.v_b)
        if lora is not None:
            lora.add(h, i, "qkv", (q, k, v))
        q = q.view(n_tok, s.num_heads, s.head_dim)
        k = k.view(n_tok, s.num_kv_heads, s.head_dim)
        v = v.view(n_tok, s.num_kv_heads, s.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, eps)
            k = rms_norm(k, w.k_norm, eps)
        return apply_rotary_(q, cos, sin), apply_rotary_(k, cos, sin), v

    def after_attention(self, i: int, x: torch.Tensor, o: torch.Tensor,
                        lora: LoRAGroups | None = None) -> torch.Tensor:
        """Block `i`'s output from its input `x` and its attention output `o [T, heads * head_dim]`."""
        w = self._layers[i]
        if lora is None:
            # NOTE: the residual adds land in the projections' fresh outputs (a + b == b + a exactly);
            # the first one and the norm after it are one pass (`add_rms_norm_`)
            attn = linear(o, w.o_w, w.o_b)
            h = add_rms_norm_(attn, x, w.post_norm, self.spec.rms_norm_eps)  # attn <- attn + x
            return self.mlp(i, h).add_(attn)
        attn = linear(o, w.o_w, w.o_b)  # NOTE: the base products as the plain path's: a base row's bits alike
        lora.add(o, i, "o", (attn,))
        x = x + attn
        h = rms_norm(x, w.post_norm, self.spec.rms_norm_eps)
        return x + (self.lora_mlp(i, h, lora) if lora.adapts(i, MLP_PROJS) else self.mlp(i, h))

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        w = self._layers[i]
        return swiglu(h, w.gate_w, w.up_w, w.down_w, w.gate_b, w.up_b, w.down_b)

    def lora_mlp(self, i: int, h: torch.Tensor, lora: LoRAGroups) -> torch.Tensor:
        """`mlp` with the adapters' updates of gate, up and down (dense MLP layers only)."""
        w = self._layers[i]
        gate, up = linear(h, w.gate_w, w.gate_b), linear(h, w.up_w, w.up_b)
        lora.add(h, i, "gate_up", (gate, up))
        act = F.silu(gate) * up
        down = linear(act, w.down_w, w.down_b)
        lora.add(act, i, "down", (down,))
        return down

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head over the rows of `x` whose logits are wanted."""
        return lm_head(rms_norm(x, self._final_norm, self.spec.rms_norm_eps), self._lm_head)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.forward(*args, **kwargs)  # NOTE: late-bound, so subclasses' forward is the one called

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"DenseDecoder({s.family.value}, layers={s.num_layers}, hidden={s.hidden_size}, "
            f"heads={s.num_heads}/{s.num_kv_heads}, {s.dtype}, {self.device}, "
            f"backend={self.backend.kind.value})"
        )
