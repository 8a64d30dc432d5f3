"""A training forward of the dense decoder on the engine's own kernels, in the engine's order.

Why: under `InferenceConfig.batch_invariant` a sampled token's log-prob depends only on its own
sequence, so a trainer that recomputes it with the very pieces the engine's step runs gets the same
bits: the log-probs the loss sees equal the ones the engine sampled with (zero mismatch), without
copying them from the engine's outputs.

How: the sequences are laid out as one prefill of each (a scratch paged KV cache of their own, the
engine's block size), and each piece of a block runs as an autograd function whose forward is the
engine decoder's own method (`attention_inputs`, the attention backend, `after_attention`, `head`,
then the sampler's RAW normaliser) and whose backward is torch's autograd of the same maths written
plainly (HF's op order), recomputed at the forward's inputs, as activation checkpointing does. The
values are the engine's; the gradient of each piece is torch's at those values, so a step's gradient
is torch's autograd of the policy within fp32 rounding.

The gradients reach the trainer's parameters, which the decoder (and a LoRA adapter) must alias (a
colocated engine): the forward reads the engine's tensors, the backward hands gradients to the
parameters with the same storage. Covered: the dense decoder on CPU, fp32 or bf16, the base model or
one shared LoRA adapter on every row; RAW log-probs at T = 1, PROCESSED ones at any other T (the
sampler's two modes there; no logit processors or truncation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from inference.attention.metadata import AttentionMetadata
from inference.attention.selector import select_backend
from inference.lora.adapter import LoRAAdapter
from inference.lora.batch import LoRAGroups
from inference.models import small_gemm
from inference.models.dense.decoder import EMBED, FINAL_NORM, LM_HEAD, DenseDecoder, LayerTensors
from inference.models.layers import apply_rotary
from inference.sampling.sampler import processed_logprobs, raw_logprobs

# the tensors of a block each piece reads, by `LayerTensors` attribute (in the order the references take them)
_INPUT_FIELDS = ("in_norm", "q_w", "q_b", "k_w", "k_b", "v_w", "v_b", "q_norm", "k_norm")
_AFTER_FIELDS = ("o_w", "o_b", "post_norm", "gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b")
# the projections an adapter may adapt, by the piece that reads them (in the order the references take them)
_INPUT_PROJS = ("q_proj", "k_proj", "v_proj")
_AFTER_PROJS = ("o_proj", "gate_proj", "up_proj", "down_proj")


class _EngineValues(torch.autograd.Function):
    """`engine(*inputs)`'s values; in backward, the gradient of `reference(*inputs)` at those inputs."""

    @staticmethod
    def forward(ctx: Any, engine: Callable, reference: Callable, *inputs: torch.Tensor | None):
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            out = engine(*inputs)
        return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_(need)
                      for t, need in zip(ctx.saved_tensors, needs)]
            outs = ctx.reference(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                   if pairs and wanted else [None] * len(wanted))
        return (None, None, *(next(got) if leaf is not None and leaf.requires_grad else None for leaf in leaves))


def engine_values(engine: Callable, reference: Callable, *inputs: torch.Tensor | None):
    """`engine(*inputs)` (a tensor or a tuple), differentiable as `reference(*inputs)` is."""
    return _EngineValues.apply(engine, reference, *inputs)


# -- the plain maths, for the gradients (HF transformers' op order) ------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _project(h, w, b, lora_a, lora_b, scale: float):
    """A projection, plus its adapter's update where it has one (PEFT's maths: scale x B A h)."""
    y = F.linear(h, w, b)
    return y if lora_a is None else y + scale * F.linear(F.linear(h, lora_a), lora_b)


def _attention_inputs(decoder: DenseDecoder, scales, x, cos, sin, in_norm, q_w, q_b, k_w, k_b, v_w, v_b, q_norm,
                      k_norm, qa=None, qb=None, ka=None, kb=None, va=None, vb=None):
    s = decoder.spec
    h = _rms_norm(x, in_norm, s.rms_norm_eps)
    q = _project(h, q_w, q_b, qa, qb, scales[0]).view(x.shape[0], s.num_heads, s.head_dim)
    k = _project(h, k_w, k_b, ka, kb, scales[1]).view(x.shape[0], s.num_kv_heads, s.head_dim)
    v = _project(h, v_w, v_b, va, vb, scales[2]).view(x.shape[0], s.num_kv_heads, s.head_dim)
    if q_norm is not None:
        q, k = _rms_norm(q, q_norm, s.rms_norm_eps), _rms_norm(k, k_norm, s.rms_norm_eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def _after_attention(decoder: DenseDecoder, scales, x, o, o_w, o_b, post_norm, gate_w, gate_b, up_w, up_b, down_w,
                     down_b, oa=None, ob=None, ga=None, gb=None, ua=None, ub=None, da=None, db=None):
    x = x + _project(o, o_w, o_b, oa, ob, scales[0])
    h = _rms_norm(x, post_norm, decoder.spec.rms_norm_eps)
    act = F.silu(_project(h, gate_w, gate_b, ga, gb, scales[1])) * _project(h, up_w, up_b, ua, ub, scales[2])
    return x + _project(act, down_w, down_b, da, db, scales[3])


def _causal_attention(rows: tuple[torch.Tensor, torch.Tensor], scale: float, q, k, v) -> torch.Tensor:
    """Each sequence's causal attention over its own rows of `q [T, Hq, D]`, `k`, `v [T, Hkv, D]`; flat row j
    is sequence `rows[0][j]`'s token `rows[1][j]`. One batched call over the sequences right-padded (a
    padding row comes after every real one, so the causal mask hides it from them)."""
    seq, pos = rows
    batch, length = int(seq.max()) + 1, int(pos.max()) + 1

    def padded(t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros(batch, length, *t.shape[1:]).index_put((seq, pos), t).transpose(1, 2)

    o = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True, scale=scale,
                                       enable_gqa=True)
    return o.transpose(1, 2)[seq, pos].reshape(q.shape[0], -1)


def _logprobs_reference(temperature: float, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits.float() / temperature, -1).gather(1, targets[:, None])[:, 0]


# -- the forward ---------------------------------------------------------------------------------


class TrainingForward:
    """`forward(input_ids, loss_mask) -> (logits, logprobs, targets)` of the trainer's policy, computed by
    `decoder`'s kernels in its order; gradients flow to `params` (the trainer's parameters, by any names:
    each of the decoder's tensors must alias one). `block_size`: the engine's (its attention steps over a
    block's tokens). `adapter`: the engine's current LoRA adapter of the policy, shared (its A and B the
    trainer's own parameters), read at each call; None: the base model."""

    def __init__(self, decoder: DenseDecoder, params: Mapping[str, torch.Tensor], *, block_size: int,
                 padding_idx: int | None = None, temperature: float = 1.0,
                 adapter: Callable[[], LoRAAdapter] | None = None) -> None:
        if type(decoder) is not DenseDecoder:
            raise ValueError(f"TrainingForward covers the dense decoder, not {type(decoder).__name__}")
        if decoder.device.type != "cpu":
            raise ValueError(f"TrainingForward runs on the CPU, where the engine's kernels are; not {decoder.device}")
        if not temperature > 0:
            raise ValueError(f"TrainingForward: temperature must be > 0, got {temperature}")
        self.decoder = decoder
        self.block_size = block_size
        self.padding_idx = padding_idx  # NOTE: the trainer's embedding's: its row gets no gradient, as in torch
        self.temperature = float(temperature)  # 1: RAW log-probs; else PROCESSED ones (the sampler's modes)
        self.adapter = adapter
        self._by_storage = {(p.data_ptr(), tuple(p.shape)): p for p in params.values()}
        b = decoder.backend
        self._backend = select_backend(b.num_heads, b.num_kv_heads, b.head_dim, dtype=decoder.dtype,
                                       device=decoder.device, scale=b.scale, kind=b.kind)
        self._resolve()

    def _param_of(self, what: str, tensor: torch.Tensor) -> torch.Tensor:
        """The trainer's parameter that is `tensor` (the same storage and shape): values come from the
        engine's tensors and gradients go to the parameters, so they must be one."""
        param = self._by_storage.get((tensor.data_ptr(), tuple(tensor.shape)))
        if param is None:
            raise ValueError(f"TrainingForward: {what} is not the trainer's parameter (the engine must alias the "
                             "trainer's weights: a colocated engine with share_weights, a shared adapter)")
        return param

    def _resolve(self) -> None:
        """The trainer's parameters in the decoder's places (again per call: an update may rebind them)."""
        d = self.decoder
        params = {name: self._param_of(f"the decoder's {name}", t) for name, t in d.named_tensors().items()}
        self._embed, self._final_norm = params[EMBED], params[FINAL_NORM]
        self._lm_head = params[EMBED] if d.spec.tie_word_embeddings else params[LM_HEAD]
        self._layers = [LayerTensors(params, i) for i in range(d.spec.num_layers)]

    def __call__(self, input_ids: torch.Tensor, loss_mask: torch.Tensor):
        """Right-padded `input_ids [B, T]` (as `RolloutBatch.to_padded_tensors` lays them out) and the
        tokens to score, `loss_mask [B, T]`: `[N, vocab]` fp32 logits / temperature of the positions
        predicting them, `[N]` their log-probs (RAW at temperature 1, else PROCESSED: the sampler's own
        sums) and `[N]` the tokens, in the row-major order of `loss_mask.nonzero()`."""
        if loss_mask[:, 0].any():
            raise ValueError("TrainingForward: the first position has nothing to predict it")
        self._resolve()
        lengths = [int(row.nonzero()[-1]) + 1 if row.any() else 0 for row in loss_mask]
        rows = [r for r, n in enumerate(lengths) if n]
        lengths = [lengths[r] for r in rows]
        ids = torch.cat([input_ids[r, :n] for r, n in zip(rows, lengths)]).cpu()
        positions = torch.cat([torch.arange(n) for n in lengths])
        # the predicting positions, in the flat layout: row r's token at column c is predicted by c - 1
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        mask_rows, cols = loss_mask[rows].nonzero(as_tuple=True)
        predicting = starts[mask_rows.cpu()] + cols.cpu() - 1
        targets = ids.index_select(0, predicting + 1)
        with small_gemm.fixed_order():
            logits = self._logits(ids, positions, lengths, predicting)
            t = self.temperature
            engine = raw_logprobs if t == 1.0 else lambda x, ids: processed_logprobs(x, ids, t)
            logprobs = engine_values(engine, lambda *a: _logprobs_reference(t, *a), logits, targets)
        return (logits.float() if t == 1.0 else logits.float() / t), logprobs, targets

    def _lora(self, rows: int) -> tuple[LoRAGroups | None, list[dict[str, tuple]]]:
        """The step's LoRA grouping (every row the adapter's) and, per layer, each adapted projection's
        (A, B, scale) as the trainer's parameters."""
        layers: list[dict[str, tuple]] = [{} for _ in self._layers]
        if self.adapter is None:
            return None, layers
        adapter = self.adapter()
        if not adapter.shared:
            raise ValueError(f"TrainingForward: LoRA adapter {adapter.name!r} is a copy; the trainer's forward needs "
                             "the engine to share the trainer's (load_lora_from_peft(..., share=True))")
        for i, (own, scales) in enumerate(zip(adapter.layers, adapter.scales, strict=True)):
            for proj, (a, b) in own.items():
                layers[i][proj] = (self._param_of(f"{adapter.name}'s {proj} A", a),
                                   self._param_of(f"{adapter.name}'s {proj} B", b), scales[proj])
        groups = LoRAGroups(np.zeros(rows, dtype=np.int64), lambda _: adapter, self.decoder.device, small_gemm.linear)
        return groups, layers

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, lengths: list[int], predicting: torch.Tensor):
        d, bs = self.decoder, self.block_size
        tables, next_block = [], 0
        for n in lengths:
            blocks = -(-n // bs)
            tables.append(list(range(next_block, next_block + blocks)))
            next_block += blocks
        cache = d.new_kv_cache(next_block, bs)
        meta = AttentionMetadata.build(lengths, lengths, tables, bs)
        d.check_sequence_lengths(meta)
        self._backend.plan(meta, cache)
        rows = (torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)), positions)
        groups, adapted = self._lora(ids.shape[0])
        with torch.no_grad():
            cos, sin = d.rope(positions)
        x = F.embedding(ids, self._embed, padding_idx=self.padding_idx)
        for i, (w, lora) in enumerate(zip(self._layers, adapted)):
            into, into_scales = _adapter_inputs(lora, _INPUT_PROJS)
            q, k, v = engine_values(lambda x, cos, sin, *_, i=i: d.attention_inputs(i, x, cos, sin, groups),
                                    lambda *a, sc=into_scales: _attention_inputs(d, sc, *a),
                                    x, cos, sin, *(getattr(w, f) for f in _INPUT_FIELDS), *into)
            # NOTE: cloned: the backend's output may be a buffer it reuses for the next layer's
            o = engine_values(lambda q, k, v, i=i: self._backend.forward(i, q, k, v, cache).clone(),
                              lambda *a: _causal_attention(rows, self._backend.scale, *a), q, k, v)
            after, after_scales = _adapter_inputs(lora, _AFTER_PROJS)
            x = engine_values(lambda x, o, *_, i=i: d.after_attention(i, x, o, groups),
                              lambda *a, sc=after_scales: _after_attention(d, sc, *a),
                              x, o, *(getattr(w, f) for f in _AFTER_FIELDS), *after)
        x = x.index_select(0, predicting)
        eps = d.spec.rms_norm_eps
        return engine_values(lambda x, *_: d.head(x), lambda x, n, w: F.linear(_rms_norm(x, n, eps), w),
                             x, self._final_norm, self._lm_head)


def _adapter_inputs(lora: dict[str, tuple], projs: tuple[str, ...]) -> tuple[list, tuple[float, ...]]:
    """(A, B of each of `projs` in turn, None where not adapted; their scales)."""
    tensors, scales = [], []
    for proj in projs:
        a, b, scale = lora.get(proj, (None, None, 1.0))
        tensors += [a, b]
        scales.append(scale)
    return tensors, tuple(scales)
