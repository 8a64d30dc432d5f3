"""Backend selection: torch on CPU, flashinfer only with CUDA and the package, never imported eagerly."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from inference.attention import AttentionBackendKind, TorchAttentionBackend, select_backend
from inference.attention.selector import flashinfer_available


def test_cpu_selects_torch():
    backend = select_backend(4, 2, 16, dtype=torch.float32, device="cpu")
    assert isinstance(backend, TorchAttentionBackend)
    assert backend.kind is AttentionBackendKind.TORCH and backend.group_size == 2
    assert backend.scale == pytest.approx(16**-0.5)
    assert not flashinfer_available("cpu")


def test_flashinfer_on_cpu_is_refused_not_substituted():
    with pytest.raises(RuntimeError, match="flashinfer backend needs CUDA"):
        select_backend(4, 2, 16, dtype=torch.float32, device="cpu", kind=AttentionBackendKind.FLASHINFER)


def test_bad_head_counts_rejected():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        select_backend(5, 2, 16, dtype=torch.float32, device="cpu")


def test_importing_backends_does_not_import_flashinfer():
    code = (
        "import sys, inference.attention, inference.attention.flashinfer_backend, inference.models\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
