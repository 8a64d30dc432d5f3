"""Choose the attention backend: flashinfer on CUDA when it is installed, else torch."""

from __future__ import annotations

import importlib.util
import logging

import torch

from inference.attention.base import AttentionBackend, AttentionBackendKind

logger = logging.getLogger(__name__)


def flashinfer_available(device: torch.device | str) -> bool:
    """True when `device` is CUDA and the `flashinfer` package can be found (not imported)."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("flashinfer") is not None


def select_backend(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    scale: float | None = None,
    kind: AttentionBackendKind | None = None,
) -> AttentionBackend:
    """Build a backend; `kind=None` picks flashinfer for fp16/bf16 on CUDA when it is installed,
    torch otherwise (flashinfer has no fp32 kernels).

    Asking for FLASHINFER where it cannot run raises RuntimeError rather than falling back, so
    a benchmark never measures a different backend than it names.
    """
    if kind is None:
        use_fi = flashinfer_available(device) and dtype in (torch.float16, torch.bfloat16)
        kind = AttentionBackendKind.FLASHINFER if use_fi else AttentionBackendKind.TORCH
    args = (num_heads, num_kv_heads, head_dim)
    kwargs = dict(scale=scale, dtype=dtype, device=device)
    if kind is AttentionBackendKind.FLASHINFER:
        if not flashinfer_available(device):
            raise RuntimeError(f"flashinfer backend needs CUDA and the flashinfer package (device={device})")
        # NOTE: imported here so that CPU-only installs never import flashinfer's module
        from inference.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(*args, **kwargs)
    from inference.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(*args, **kwargs)
