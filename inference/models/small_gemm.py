"""`linear` for the decode step: the native few-row GEMM on CPU (`csrc/small_gemm.c`), else `F.linear`.

At the tail of a rollout batch a decode step carries a handful of rows, and MKL's sgemm at 2-8
rows runs well below the memory bandwidth its gemv reaches at one row (SmolLM2-135M fp32, one
thread, all of a step's GEMMs: 1 row 28 ms, 2 rows 54, 3 rows 80, 8 rows 85; the native kernel
19, 25, 26, 77). The native kernel reads each weight row once for all the rows. It also computes
each row alike whatever the row count, so a row's outputs are the same bits in a one-row step
and in an eight-token verify step (speculation on and off then agree bit for bit in the tail).
Past `MAX_ROWS` rows MKL is faster (measured: 12 rows 78 against 110 ms), and takes over.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference import native

MAX_ROWS = 8  # up to here the native kernel (measured above); the C side accepts up to 16


def few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear(x, weight, bias)` takes the native kernel."""
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.stride(1) == 1
            and weight.is_contiguous() and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
            and native.available())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; a few fp32 rows on CPU through the native kernel (module docstring)."""
    return native_linear(x, weight, bias) if few_rows(x, weight, bias) else F.linear(x, weight, bias)


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The native kernel's `x @ weight.T (+ bias)`, for inputs `few_rows` accepts."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    status = native.library().small_gemm_f32(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(), weight.shape[0],
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads())
    if status:
        raise RuntimeError(f"small_gemm_f32 failed with status {status} "
                           f"(x {tuple(x.shape)}, weight {tuple(weight.shape)})")
    return out
