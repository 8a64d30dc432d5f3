"""Weights packed once for a kernel's layout, not on every call; bf16 linear layers on CPU through oneDNN.

`F.linear` in bf16 on a CPU oneDNN takes (AVX-512) reorders the weight into oneDNN's blocked
layout on every call: at a decode step's few rows the reorder costs as much as the product
(SmolLM2's 576 x 3072 at one row, 2 threads, Zen 4: 137 us, packed 58; its 49152-row LM head
4.3 ms, packed 2.5). `torch.ops.mkldnn._reorder_linear_weight` does it once, and
`_linear_pointwise` then runs the same oneDNN kernel as `F.linear`: the same bits, whatever the row
count (tested), so packing changes no numerics. The dense decoder's few-row products take the
native bf16 kernel instead (`small_gemm.py`, on a pack in its own layout kept here too); these
oneDNN packs serve where the kernels are not built, and the hybrid models' projections.

Weights a layer multiplies by the same input (q, k and v; gate and up) share one pack, side by side
(`linear_group`): one call instead of three or two, each output the same bits (SmolLM2, 2 threads:
q, k, v at 1 / 8 / 64 rows 58 / 77 / 223 -> 26 / 41 / 191 us; gate and up 78 / 115 / 579 -> 50 / 92 / 590).

A pack is remembered per weight tensor (or group) and layout, keyed by its tensors' version
counters and storage, so a weight written in place (a weight update's copy, a colocated trainer's
optimizer step on an aliased tensor) is packed again on its next use. The weight manager, the one
writer of the engine's weights, drops every pack (`forget_all`) when it commits new weights,
offloads or discards them, so a pack never holds memory its weights gave back. A pack costs a
second copy of its weight (bf16 on CPU only). fp32 stays on the native kernel and MKL
(`small_gemm.py`): oneDNN's fp32 product rounds differently from `F.linear`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from functools import cache
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


class _Pack(NamedTuple):
    refs: tuple[weakref.ref, ...]  # the weights (and biases) packed together
    state: tuple[tuple[int, int], ...]  # their versions and addresses when packed (`_state`)
    packed: torch.Tensor  # the weights side by side in the pack's layout
    bias: Optional[torch.Tensor]  # their biases side by side, or None
    numel: int  # the weights' elements


_packs: dict[tuple, _Pack] = {}  # by the layout and the ids of the tensors packed together
# NOTE: re-entrant: a weight dying while this thread holds the lock (a collection run by an allocation inside
# it, a transient view used as a weight) calls its pack's `drop` on this thread, which takes the lock again
_lock = threading.RLock()
# NOTE: bumped whenever a pack is made or dropped: while it is unchanged every pack handed out is still
# held here, so a caller that kept a pack's address (`native_layers`) may go on using it
_generation = 0


@cache
def supported() -> bool:
    """Whether this CPU runs bf16 products in oneDNN, as `F.linear` itself does here."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def packable(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """Whether `linear(x, weight, bias)` takes a packed weight: bf16 on a CPU oneDNN serves."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and x.device.type == "cpu" and weight.device.type == "cpu"
            and not (weight.requires_grad and torch.is_grad_enabled())  # NOTE: the packed op has no backward
            and (bias is None or bias.dtype == torch.bfloat16) and torch.backends.mkldnn.enabled
            and supported())


def _state(tensor: torch.Tensor) -> tuple[int, int]:
    # NOTE: every in-place op on the tensor (copy_, set_, resize_) bumps its version; a storage resized
    # under it (the weight manager's offload) does not, and that path drops every pack itself
    return tensor._version, tensor.data_ptr()


def _onednn_layout(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # NOTE: the batch hint changes no bits


def cached_pack(weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor, ...] = (),
                layout: Callable[[torch.Tensor], torch.Tensor] = _onednn_layout):
    """The weights side by side (one `[sum of rows, in]` weight) in `layout` (by default oneDNN's), and
    their biases side by side (None without): remembered per layout, packed again once any of them
    was written or freed."""
    tensors = weights + biases
    key, state = (layout, *map(id, tensors)), tuple(map(_state, tensors))
    entry = _packs.get(key)
    if entry is not None and entry.state == state and all(ref() is t for ref, t in zip(entry.refs, tensors)):
        return entry.packed, entry.bias
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    packed = layout(weight.detach())
    bias = (biases[0] if len(biases) == 1 else torch.cat(biases)).detach() if biases else None

    def drop(ref: weakref.ref, key: tuple = key) -> None:
        with _lock:
            if key in _packs and ref in _packs[key].refs:
                del _packs[key]
                _bump()

    with _lock:
        _packs[key] = _Pack(tuple(weakref.ref(t, drop) for t in tensors), state, packed, bias, weight.numel())
        _bump()
    return packed, bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the weight's pack where `packable` (the same bits)."""
    if not packable(x, weight, bias):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, cached_pack((weight,))[0], bias, "none", [], "")


def linear_group(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                 biases: tuple[Optional[torch.Tensor], ...]) -> Optional[torch.Tensor]:
    """`x` times the weights side by side, `[..., sum of their rows]` (q, k and v; gate and up): one
    oneDNN call on one pack instead of one per weight, each output the same bits as its own
    `F.linear` (tested). None where the weights are not `packable`, or only some have a bias."""
    if not all(packable(x, w, b) for w, b in zip(weights, biases)):  # NOTE: first: fp32 leaves at once
        return None
    with_bias = [b is not None for b in biases]
    if any(with_bias) != all(with_bias):
        return None
    packed, bias = cached_pack(tuple(weights), tuple(biases) if all(with_bias) else ())
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def forget_all() -> None:
    """Drop every pack (new weights were committed, or the weights offloaded or discarded)."""
    with _lock:
        _packs.clear()
        _bump()


def _bump() -> None:
    global _generation
    _generation += 1


def generation() -> int:
    """A count of the packs made and dropped so far (see `_generation`)."""
    return _generation


def packed_bytes() -> int:
    """What the packs hold now (their weights' bytes)."""
    with _lock:
        entries = list(_packs.values())
    return sum(entry.numel * 2 for entry in entries)  # NOTE: bf16
