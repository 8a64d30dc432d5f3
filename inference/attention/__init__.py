"""Attention backends behind one interface (torch reference, flashinfer on GPU)."""

from inference.attention.base import AttentionBackend, AttentionBackendKind
from inference.attention.metadata import AttentionMetadata, BatchSplit, split_decode_prefill
from inference.attention.selector import flashinfer_available, select_backend
from inference.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "AttentionBackendKind",
    "AttentionMetadata",
    "BatchSplit",
    "TorchAttentionBackend",
    "flashinfer_available",
    "select_backend",
    "split_decode_prefill",
]
