"""The hybrid decoder: attention, Mamba2 and MLP blocks in a per-layer pattern, over paged KV
for its attention layers and the engine's state pool for its Mamba layers.

Like `DenseDecoder` it is functional over HF-named tensors (aliasing a trainer's parameters or
holding copies). Its caches: one paged KV cache over the attention layers (in pattern order),
and two per-request states, `conv` (`[mamba_layers, conv_dim, K - 1]`, model dtype) and `ssm`
(`[mamba_layers, heads, head_dim, state]`, fp32).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
import torch.nn.functional as F

from inference.attention.base import AttentionBackend
from inference.attention.metadata import AttentionMetadata
from inference.attention.selector import select_backend
from inference.cache.kv_buffer import KVCacheBuffer
from inference.cache.specs import CacheSpec, KVCacheSpec, StateSpec
from inference.models.dense.decoder import BindReport, DenseDecoder
from inference.models.hybrid import kernels as mamba_kernels
from inference.models.hybrid.mamba2 import Mamba2Weights, mamba2_layer
from inference.models.hybrid.spec import HybridSpec, MixerKind, MixerSpec
from inference.models.hybrid.verify import advance_layer, verify_layer
from inference.models.layers import RotaryEmbedding, apply_rotary, lm_head, rms_norm
from inference.models.packed_weights import linear  # NOTE: F.linear, bf16 on CPU through a pack (same bits)
from inference.models.protocol import StateBatch

CONV_STATE = "conv"
SSM_STATE = "ssm"


class _Mixer:
    """One mixer's resolved tensors and its index among layers of its kind."""

    __slots__ = ("spec", "index", "w")

    def __init__(self, spec: MixerSpec, index: int, w) -> None:
        self.spec, self.index, self.w = spec, index, w


class HybridDecoder:
    """A hybrid attention + Mamba2 decoder (see module docstring).

    Invariants: `named_tensors()` holds exactly `spec.weight_shapes()` (HF names, one dtype, one
    device); the forward only reads weights. A request's Mamba state is read from its state rows
    at the start of its tokens and written back at their end, so the engine may move, copy,
    snapshot or drop those rows between steps.
    """

    # NOTE: no `lora_targets`: its mixers (Mamba2 in/out projections, attention, MLP) compute their
    # projections themselves, without the grouped LoRA update; adapters are refused with this reason
    lora_refusal = ("LoRA is not implemented for hybrid (Mamba) models yet: their mixers' projections do "
                    "not take the per-request adapter update; serve adapters on a dense or MoE model")
    # NOTE: weight handling is the dense decoder's, which only needs `spec`, `_tensors` and `_resolve`
    named_tensors = DenseDecoder.named_tensors
    bind_weights = DenseDecoder.bind_weights
    _check = DenseDecoder._check
    dtype = DenseDecoder.dtype

    def __init__(self, spec: HybridSpec, tensors: Mapping[str, torch.Tensor], *,
                 backend: Optional[AttentionBackend] = None) -> None:
        self.spec = spec
        expected = spec.weight_shapes()
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise KeyError(f"HybridDecoder: missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}")
        self.device = tensors[spec.embed].device
        self._tensors: dict[str, torch.Tensor] = {}
        for name, shape in expected.items():
            t = tensors[name]
            self._check(name, t, shape)
            if t.dtype != spec.dtype or t.device != self.device:
                raise ValueError(f"HybridDecoder: {name} is {t.dtype} on {t.device}, expected {spec.dtype} on "
                                 f"{self.device}")
            self._tensors[name] = t.detach()
        self.bind_report: Optional[BindReport] = None
        rotary = spec.rotary_dim or spec.head_dim
        self.rotary = RotaryEmbedding(spec.rope, rotary, self.device) if spec.rope is not None else None
        self.backend = backend or select_backend(spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                                 dtype=spec.dtype, device=self.device)
        self.kernels = mamba_kernels.select(self.device, spec.dtype)  # None: the torch path
        self._proj_scale = spec.mamba.proj_scale(spec.dtype, self.device) if spec.mamba is not None else None
        self._last_sequence_block = max(i for i, b in enumerate(spec.blocks) if b.mixes_sequence)
        self._resolve()

    def _resolve(self) -> None:
        t, s = self._tensors, self.spec
        self._embed = t[s.embed]
        self._final_norm = t[s.final_norm]
        self._lm_head = t[s.embed] if s.tie_word_embeddings else t["lm_head.weight"]
        counts = {kind: 0 for kind in MixerKind}
        self._blocks: list[tuple[torch.Tensor, list[_Mixer]]] = []
        for block in s.blocks:
            mixers = []
            for m in block.mixers:
                mixers.append(_Mixer(m, counts[m.kind], self._mixer_tensors(m)))
                counts[m.kind] += 1
            self._blocks.append((t[block.norm], mixers))
        self._mamba = [m for _, mixers in self._blocks for m in mixers if m.spec.kind is MixerKind.MAMBA]

    def _mixer_tensors(self, m: MixerSpec):
        t, p = self._tensors, m.prefix
        if m.kind is MixerKind.MAMBA:
            return Mamba2Weights(t[p + "in_proj.weight"], t.get(p + "in_proj.bias"), t[p + "conv1d.weight"],
                                 t.get(p + "conv1d.bias"), t[p + "dt_bias"], t[p + "A_log"], t[p + "D"],
                                 t.get(p + "norm.weight"), t[p + "out_proj.weight"], t.get(p + "out_proj.bias"))
        if m.kind is MixerKind.ATTENTION:
            return tuple(t.get(f"{p}{proj}_proj.{kind}") for proj in "qkvo" for kind in ("weight", "bias"))
        return tuple(t.get(f"{p}{proj}_proj.{kind}") for proj in ("gate", "up", "down") for kind in ("weight", "bias"))

    # ---- cache -----------------------------------------------------------------------------

    def cache_specs(self) -> list[CacheSpec]:
        """Paged KV for the attention layers; conv and SSM state per request for the Mamba layers."""
        s = self.spec
        specs: list[CacheSpec] = [KVCacheSpec(s.num_attention_layers, s.num_kv_heads, s.head_dim, s.dtype)]
        if s.num_mamba_layers:
            d, n = s.mamba, s.num_mamba_layers
            specs += [StateSpec(CONV_STATE, (n, *d.conv_state_shape), s.dtype),
                      StateSpec(SSM_STATE, (n, *d.ssm_state_shape), torch.float32)]
        return specs

    # ---- forward ---------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCacheBuffer,
                meta: AttentionMetadata, logits_indices: torch.Tensor, *,
                states: Optional[StateBatch] = None) -> torch.Tensor:
        """Logits `[R, vocab]` for the flat-batch rows `logits_indices` (see `CausalLM.forward`)."""
        s = self.spec
        if s.num_mamba_layers and states is None:
            raise ValueError("HybridDecoder needs its Mamba state rows (states=)")
        x = F.embedding(input_ids, self._embed)
        if s.embedding_multiplier != 1.0:
            x = x * s.embedding_multiplier
        self.backend.plan(meta, kv_cache)
        cos_sin = self.rotary.cos_sin(positions, s.dtype) if self.rotary is not None else None
        step = _MambaStep(meta, states) if states is not None and s.num_mamba_layers else None
        for i, (norm_w, mixers) in enumerate(self._blocks):
            h = self._norm(x, norm_w)
            out = None
            for mixer in mixers:
                m = mixer.spec
                y = self._mix(mixer, h * m.in_mult if m.in_mult != 1.0 else h, cos_sin, kv_cache, step)
                if m.out_mult != 1.0:
                    y = y * m.out_mult
                out = y if out is None else out + y
            if i == self._last_sequence_block:
                # NOTE: past the last attention / Mamba mixer everything is row-wise: only sampled rows go on
                x, out = x.index_select(0, logits_indices), out.index_select(0, logits_indices)
            x = x + out
        logits = lm_head(self._norm(x, self._final_norm), self._lm_head)
        return logits * s.lm_head_multiplier if s.lm_head_multiplier != 1.0 else logits

    @torch.no_grad()
    def advance_states(self, states: StateBatch, kept: list[int]) -> None:
        """After a verify forward with `states.verify`: move request `b`'s state rows over the first
        `kept[b]` of its verify rows (see `hybrid/verify.py`)."""
        verify, s = states.verify, self.spec
        if verify is None or len(verify.trail) != s.num_mamba_layers:
            raise ValueError("advance_states needs the trail of a verify forward over every Mamba layer")
        conv, ssm = states.tensors[CONV_STATE], states.tensors[SSM_STATE]
        for record in verify.trail:
            i = record.layer
            advance_layer(record, self._mamba[i].w, s.mamba, conv[:, i], ssm[:, i], states.slots, verify.lens, kept)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.spec.rms_norm_eps
        if self.spec.norm_weight_fp32 and x.dtype != torch.float32:
            return (weight.float() * F.rms_norm(x.float(), (x.shape[-1],), eps=eps)).to(x.dtype)
        return rms_norm(x, weight, eps)

    def _mix(self, mixer: _Mixer, h: torch.Tensor, cos_sin, kv_cache: KVCacheBuffer,
             step: Optional[_MambaStep]) -> torch.Tensor:
        kind, w = mixer.spec.kind, mixer.w
        if kind is MixerKind.MAMBA:
            return step.run(self, mixer, h)
        if kind is MixerKind.ATTENTION:
            return self._attention(mixer.index, w, h, cos_sin, kv_cache)
        gate_w, gate_b, up_w, up_b, down_w, down_b = w
        if kind is MixerKind.RELU2:
            return linear(torch.relu(linear(h, up_w, up_b)).square(), down_w, down_b)
        s = self.spec
        gate = linear(h, gate_w, gate_b)
        if s.gate_multiplier != 1.0:
            gate = gate * s.gate_multiplier
        y = linear(linear(h, up_w, up_b) * F.silu(gate), down_w, down_b)
        return y * s.down_multiplier if s.down_multiplier != 1.0 else y

    def _attention(self, layer: int, w, h: torch.Tensor, cos_sin, kv_cache: KVCacheBuffer) -> torch.Tensor:
        s = self.spec
        q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b = w
        n = h.shape[0]
        q = linear(h, q_w, q_b).view(n, s.num_heads, s.head_dim)
        k = linear(h, k_w, k_b).view(n, s.num_kv_heads, s.head_dim)
        v = linear(h, v_w, v_b).view(n, s.num_kv_heads, s.head_dim)
        if s.key_multiplier != 1.0:
            k = k * s.key_multiplier
        if cos_sin is not None:
            q, k = self._rotate(q, *cos_sin), self._rotate(k, *cos_sin)
        return linear(self.backend.forward(layer, q, k, v, kv_cache), o_w, o_b)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = cos.shape[-1]
        if rd == x.shape[-1]:
            return apply_rotary(x, cos, sin)
        return torch.cat((apply_rotary(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.forward(*args, **kwargs)

    def __repr__(self) -> str:
        s = self.spec
        return (f"HybridDecoder({s.family.value}, blocks={s.num_layers}, attention={s.num_attention_layers}, "
                f"mamba={s.num_mamba_layers}, hidden={s.hidden_size}, {s.dtype}, {self.device}, "
                f"backend={self.backend.kind.value}, mamba_kernels={'cuda' if self.kernels else 'torch'})")


class _MambaStep:
    """What every Mamba layer of one step shares: request bounds and state rows, read once."""

    __slots__ = ("bounds", "slots", "fresh", "num_decode", "conv", "ssm", "verify")

    def __init__(self, meta: AttentionMetadata, states: StateBatch) -> None:
        qsl = meta.query_start_loc_cpu if meta.query_start_loc_cpu is not None else meta.query_start_loc
        self.bounds = qsl.tolist()
        self.slots, self.fresh = states.slots, states.fresh
        self.num_decode = states.num_decode
        self.conv, self.ssm = states.tensors[CONV_STATE], states.tensors[SSM_STATE]
        self.verify = states.verify

    def run(self, model: HybridDecoder, mixer: _Mixer, h: torch.Tensor) -> torch.Tensor:
        i = mixer.index
        if self.verify is not None:
            # NOTE: the torch path on every device: verify steps run eagerly and are small (the tail
            # of a batch); the CUDA kernels' in-place state updates would need their own rollback
            out, record = verify_layer(h, mixer.w, model.spec.mamba, i, self.conv[:, i], self.ssm[:, i], self.slots,
                                       self.verify.lens, model._proj_scale)
            self.verify.trail.append(record)
            return out
        if model.kernels is not None:
            return model.kernels.layer(h, mixer.w, model.spec.mamba, self.conv[:, i], self.ssm[:, i], self.slots,
                                       self.fresh, self.bounds, self.num_decode, model._proj_scale)
        return mamba2_layer(h, mixer.w, model.spec.mamba, self.conv[:, i], self.ssm[:, i], self.slots, self.fresh,
                            self.bounds, self.num_decode, model._proj_scale)
