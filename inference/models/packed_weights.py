"""bf16 linear layers on CPU through oneDNN with each weight packed once, not on every call.

`F.linear` in bf16 on a CPU oneDNN takes (AVX-512) reorders the weight into oneDNN's blocked
layout on every call: at a decode step's few rows the reorder costs as much as the product
(SmolLM2's 576 x 3072 at one row, 2 threads, Zen 4: 137 us, packed 58; its 49152-row LM head
4.3 ms, packed 2.5). `torch.ops.mkldnn._reorder_linear_weight` does it once, and
`_linear_pointwise` then runs the same oneDNN kernel as `F.linear`: the same bits, whatever the row
count (tested), so packing changes no numerics.

A pack is remembered per weight tensor, keyed by the tensor's version counter and storage, so a
weight written in place (a weight update's copy, a colocated trainer's optimizer step on an
aliased tensor) is packed again on its next use. The weight manager, the one writer of the
engine's weights, drops every pack (`forget_all`) when it swaps, offloads, discards or restores
weights, so a pack never holds memory its weights gave back. A pack costs a second copy of its
weight (bf16 on CPU only). fp32 stays on the native kernel and MKL (`small_gemm.py`): oneDNN's
fp32 product rounds differently from `F.linear`.
"""

from __future__ import annotations

import threading
import weakref
from functools import cache
from typing import Optional

import torch
import torch.nn.functional as F

# id(weight) -> (a weak reference to it, its version and storage when packed, the pack)
_packs: dict[int, tuple[weakref.ref, tuple[int, int, int], torch.Tensor]] = {}
_lock = threading.Lock()


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


def _state(weight: torch.Tensor) -> tuple[int, int, int]:
    return weight._version, weight.data_ptr(), weight.untyped_storage().nbytes()


def pack_of(weight: torch.Tensor) -> torch.Tensor:
    """`weight` in oneDNN's layout: remembered, packed again once the weight was written."""
    key, state = id(weight), _state(weight)
    entry = _packs.get(key)
    if entry is not None and entry[0]() is weight and entry[1] == state:
        return entry[2]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)  # the batch hint changes no bits

    def drop(ref: weakref.ref, key: int = key) -> None:
        with _lock:
            if key in _packs and _packs[key][0] is ref:
                del _packs[key]

    with _lock:
        _packs[key] = (weakref.ref(weight, drop), state, packed)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the weight's pack where `packable` (the same bits)."""
    if not packable(x, weight, bias):
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, pack_of(weight), bias, "none", [], "")


def forget_all() -> None:
    """Drop every pack (the weights were swapped, offloaded, discarded or restored)."""
    with _lock:
        _packs.clear()


def packed_bytes() -> int:
    """What the packs hold now (their weights' bytes)."""
    with _lock:
        entries = list(_packs.values())
    return sum(ref().numel() * ref().element_size() for ref, _, _ in entries if ref() is not None)
