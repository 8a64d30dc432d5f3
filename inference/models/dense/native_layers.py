"""A dense decoder's blocks over a bf16 CPU step in one native call (`csrc/decode_layers_bf16.c`).

Why: at a decode step's few rows each block is a dozen small ops, and the Python between them (a
torch op or a ctypes call each, with its checks and allocations) was a third of the step (SmolLM2,
16 rows, 2 threads: ~8 of ~24 ms). The C code calls the same kernels in the same order on the same
rows as `DenseDecoder.attention_inputs`, the backend and `after_attention` do, so the logits are
the same bits (tested against the Python blocks); SwiGLU's activation is the one op new in C,
checked against torch's over every bf16 input.

`run` takes the step where every piece of the Python blocks would itself take its native kernel:
bf16 weights on the CPU, no LoRA, no q/k norms, the decoder's own blocks (not a subclass's), the
attention backend's plan attending every query row with the native decode kernel, the KV pages in
the model's dtype, and at most `MAX_ROWS` rows. Anything else returns None and the Python blocks run.
"""

from __future__ import annotations

import os
import weakref

import torch

from inference import native
from inference.attention.torch_backend import TorchAttentionBackend
from inference.cache.kv_buffer import KVCacheBuffer
from inference.models import packed_weights
from inference.models.layers import BF16_NORM_MAX_HIDDEN, native_norm_lanes
from inference.models.small_gemm import pairs_pack

# NOTE: up to the default step size (`InferenceConfig.max_batch_tokens`): a prefill step of 257-2048 rows
# ran ~10% faster here than in the Python blocks (SmolLM2, 64 clients' served-shaped load in process, Zen 5,
# interleaved: 23 such steps 5.2-5.5 s against 5.8-6.3), the same bits. The C code's workspace is ~15 KB a
# row for SmolLM2 (30 MB at 2048 rows; the Python blocks' gate and up alone are two fifths of it); past it
# the Python blocks run
MAX_ROWS = 2048
# ROLLOUT_ENGINE_NO_NATIVE_LAYERS=1 keeps the Python blocks (the native kernels they call stay on)
ENABLED = not os.environ.get("ROLLOUT_ENGINE_NO_NATIVE_LAYERS")


def _pack(weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]) -> tuple[int, int] | None:
    """The addresses of the weights' bf16 pack and their biases' (0: none), as `small_gemm.linear_group`
    packs them; None where some have a bias and some not (the Python blocks multiply them one by one)."""
    with_bias = [b is not None for b in biases]
    if any(with_bias) != all(with_bias):
        return None
    if any(w.dtype != torch.bfloat16 or w.device.type != "cpu" or w.dim() != 2 for w in weights) or any(
            b is not None and b.dtype != torch.bfloat16 for b in biases):
        return None
    packed, bias = packed_weights.cached_pack(tuple(weights), tuple(biases) if all(with_bias) else (), pairs_pack)
    if bias is not None and not bias.is_contiguous():
        return None  # NOTE: a contiguous copy would be freed before the table's address of it is read
    return packed.data_ptr(), 0 if bias is None else bias.data_ptr()


_BLOCK_TENSORS = ("in_norm", "q_w", "q_b", "k_w", "k_b", "v_w", "v_b", "o_w", "o_b", "q_norm", "post_norm",
                  "gate_w", "gate_b", "up_w", "up_b", "down_w", "down_b")
# per decoder: the state its table was built in (`_state`) and the table (None: a block does not fit)
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state(decoder, kv_cache: KVCacheBuffer) -> tuple:
    """What the table's addresses depend on: the packs (`packed_weights.generation`: unchanged, every
    pack handed out is still held, and a rebind's new tensors were packed anew), each block tensor's
    version and address (a write or a move packs again), and the KV pages' place and shape."""
    tensors = [t for w in decoder._layers for t in map(w.__getattribute__, _BLOCK_TENSORS) if t is not None]
    return (packed_weights.generation(), kv_cache.data.data_ptr(), kv_cache.num_blocks,
            tuple(map(_VERSION, tensors)), tuple(map(torch.Tensor.data_ptr, tensors)))


_VERSION = torch.Tensor._version.__get__


def _layer_table(decoder, kv_cache: KVCacheBuffer) -> torch.Tensor | None:
    """`_build_table`, kept while `_state` stays the same (building it is ~1 ms a step at 30 blocks)."""
    state = _state(decoder, kv_cache)
    kept = _tables.get(decoder)
    if kept is not None and kept[0] == state:
        return kept[1]
    table = _build_table(decoder, kv_cache)
    _tables[decoder] = (_state(decoder, kv_cache), table)  # NOTE: after packing, which bumped the generation
    return table


def _build_table(decoder, kv_cache: KVCacheBuffer) -> torch.Tensor | None:
    """Per block the 12 addresses the C code reads (`LAYER_FIELDS` there), or None where a block
    does not fit it."""
    rows = []
    for i, w in enumerate(decoder._layers):
        if w.q_norm is not None or w.in_norm.dtype != torch.bfloat16 or w.post_norm.dtype != torch.bfloat16:
            return None
        if not (w.in_norm.is_contiguous() and w.post_norm.is_contiguous()):
            return None
        qkv = _pack((w.q_w, w.k_w, w.v_w), (w.q_b, w.k_b, w.v_b))
        o = _pack((w.o_w,), (w.o_b,))
        gate_up = _pack((w.gate_w, w.up_w), (w.gate_b, w.up_b))
        down = _pack((w.down_w,), (w.down_b,))
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        pages = kv_cache.layer(i)
        rows.append([w.in_norm.data_ptr(), *qkv, *o, w.post_norm.data_ptr(), *gate_up, *down,
                     pages[0].data_ptr(), pages[1].data_ptr()])
    return torch.tensor(rows, dtype=torch.int64)


def run(decoder, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCacheBuffer,
        logits_indices: torch.Tensor) -> torch.Tensor | None:
    """The decoder's blocks over the embedded step `x [T, hidden]` (the backend planned for it), the
    last one on the rows `logits_indices` only: the input of `decoder.head`; None where the step is
    not one the C code takes (module docstring)."""
    s = decoder.spec
    backend = decoder.backend
    if not (ENABLED and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()
            and 1 <= x.shape[0] <= MAX_ROWS and isinstance(backend, TorchAttentionBackend)
            and kv_cache.dtype == torch.bfloat16 and native.available()):
        return None
    planned = backend.native_rows()
    if planned is None:
        return None
    slots, tables, seq_lens = planned
    rows, hidden = x.shape
    lanes = native_norm_lanes(x, decoder._layers[0].in_norm, torch.bfloat16)
    if (lanes is None or hidden > BF16_NORM_MAX_HIDDEN or slots.dtype != torch.int64 or not slots.is_contiguous()
            or slots.numel() != rows or tables.dtype != torch.int32 or tables.stride(1) != 1
            or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous()
            or cos.dtype != torch.bfloat16 or not cos.is_contiguous() or cos.numel() != rows * s.head_dim
            or sin.dtype != torch.bfloat16 or not sin.is_contiguous() or sin.numel() != rows * s.head_dim):
        return None
    table = _layer_table(decoder, kv_cache)
    if table is None:
        return None
    if not decoder.trim_last_layer:
        return None
    keep = logits_indices.to(torch.int64).contiguous()
    if keep.numel() == rows and bool((keep == torch.arange(rows)).all()):
        keep = None  # NOTE: every row is sampled (a decode step): the narrowing would copy them all
    out = x.clone()
    status = native.library().decode_layers_bf16(
        table.data_ptr(), table.shape[0], out.data_ptr(), rows, hidden, s.num_heads, s.num_kv_heads, s.head_dim,
        decoder._layers[0].gate_w.shape[0], cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
        tables.stride(0), seq_lens.data_ptr(), kv_cache.block_size, backend.scale, s.rms_norm_eps, lanes,
        None if keep is None else keep.data_ptr(), 0 if keep is None else keep.numel(), torch.get_num_threads())
    if status:
        raise RuntimeError(f"decode_layers_bf16 failed with status {status} (rows {rows}, hidden {hidden})")
    return out if keep is None else out[: keep.numel()]
