"""`linear` for the decode step: the native GEMM on CPU (`csrc/small_gemm.c`) in fp32, packed oneDNN
weights in bf16 (`packed_weights.py`, the same bits as `F.linear`), else `F.linear`.

A decode step carries from one row (the tail of a rollout batch) to a full batch, and MKL's
sgemm there runs below what the machine gives: at a few rows below the memory bandwidth its gemv
reaches at one row, at 16-32 rows below its matmul rate. The native kernel reads each weight once
per call and multiplies eight rows to a vector (SmolLM2-135M fp32, one thread, Zen 3: a decode
step of 16 / 32 / 64 rows 119-134 / 185-195 / 351-387 ms, with MKL's GEMMs 171 / 249-252 /
370-413; a step's GEMMs alone at one row 39 ms, MKL's 43-53). It also sums each output alike
whatever the row count, so a row's outputs are the same bits in a one-row step, in an eight-token
verify step and in a full batch (speculation on and off then agree bit for bit). Past `MAX_ROWS`
rows (prefill) MKL takes over.
"""

from __future__ import annotations

import torch

from inference import native
from inference.models import packed_weights

MAX_ROWS = 128  # up to here the native kernel (a SmolLM2 step's GEMMs: 128 rows 542 ms vs MKL's 572, 256: 1016 / 1007)


def few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear(x, weight, bias)` takes the native kernel."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.stride(1) == 1
            and weight.is_contiguous() and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
            and native.available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; up to `MAX_ROWS` fp32 rows on CPU through the native kernel (module
    docstring), bf16 on CPU through the weight's oneDNN pack."""
    if few_rows(x, weight, bias):
        return native_linear(x, weight, bias)
    return packed_weights.linear(x, weight, bias)


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, lib=None) -> torch.Tensor:
    """The native kernel's `x @ weight.T (+ bias)`, for inputs `few_rows` accepts; `lib`: another build
    of the kernels than the engine's (`native.library_at`), for tests."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    status = (lib or native.library()).small_gemm_f32(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(), weight.shape[0],
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads())
    if status:
        raise RuntimeError(f"small_gemm_f32 failed with status {status} "
                           f"(x {tuple(x.shape)}, weight {tuple(weight.shape)})")
    return out
