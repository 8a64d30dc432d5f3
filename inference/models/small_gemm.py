"""`linear` for the decode step: native GEMMs on CPU up to `MAX_ROWS` rows, fp32 (`csrc/small_gemm.c`)
and bf16 (`csrc/small_gemm_bf16.c`, on a pack of the weight made once); past that, or without the
kernels, MKL in fp32 and `F.linear` in bf16 (oneDNN, through a oneDNN pack without the kernels:
`packed_weights.py`).

A decode step carries from one row (the tail of a rollout batch) to a full batch, and MKL's
sgemm there runs below what the machine gives: at a few rows below the memory bandwidth its gemv
reaches at one row, at 16-32 rows below its matmul rate. The native kernel reads each weight once
per call and multiplies eight rows to a vector (SmolLM2-135M fp32, one thread, Zen 3: a decode
step of 16 / 32 / 64 rows 119-134 / 185-195 / 351-387 ms, with MKL's GEMMs 171 / 249-252 /
370-413; a step's GEMMs alone at one row 39 ms, MKL's 43-53). oneDNN's bf16 product likewise reads
weights at about half the bandwidth at a few rows (the bf16 kernel's header has the figures).

Both kernels sum each output alike whatever the row count, so a row's outputs are the same bits
in a one-row step, in an eight-token verify step and in a full batch (speculation on and off then
agree bit for bit). Past `MAX_ROWS` rows (prefill) MKL or oneDNN take over, with their own rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference import native
from inference.models import packed_weights

MAX_ROWS = 128  # up to here the native kernel (a SmolLM2 step's GEMMs: 128 rows 542 ms vs MKL's 572, 256: 1016 / 1007)


def few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear(x, weight, bias)` takes a native kernel (fp32 or bf16)."""
    if not (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.device.type == "cpu" and x.stride(1) == 1
            and weight.device.type == "cpu" and weight.dim() == 2 and native.available()):
        return False
    if x.dtype == torch.bfloat16:  # NOTE: the kernel reads a pack, made from any layout of the weight
        return (weight.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)
                and not (weight.requires_grad and torch.is_grad_enabled()))  # NOTE: no backward
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; up to `MAX_ROWS` fp32 or bf16 rows on CPU through a native kernel
    (module docstring), else `packed_weights.linear`."""
    if few_rows(x, weight, bias):
        if x.dtype == torch.bfloat16:
            return _bf16_product(x, (weight,), () if bias is None else (bias,))
        return native_linear(x, weight, bias)
    if x.dtype == torch.bfloat16 and native.available():
        return F.linear(x, weight, bias)  # NOTE: past MAX_ROWS not through a oneDNN pack: one pack per weight
    return packed_weights.linear(x, weight, bias)


def linear_group(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                 biases: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
    """`x` times the weights side by side, `[rows, sum of their rows]` (q, k and v; gate and up), in one
    call on one pack (each output the same bits as its own `linear`): bf16 only, through the native
    kernel up to `MAX_ROWS` rows, else `packed_weights.linear_group`; None where neither takes them
    (the caller multiplies each weight on its own)."""
    if all(few_rows(x, w, b) and x.dtype == torch.bfloat16 for w, b in zip(weights, biases)):
        with_bias = [b is not None for b in biases]
        if any(with_bias) != all(with_bias):
            return None
        return _bf16_product(x, tuple(weights), tuple(biases) if all(with_bias) else ())
    if x.dtype == torch.bfloat16 and native.available():
        return None  # NOTE: as in `linear`: past MAX_ROWS each by `F.linear`
    return packed_weights.linear_group(x, weights, biases)


def _pairs_layout(weight: torch.Tensor) -> torch.Tensor:
    """`weight [n, k]` in the bf16 kernel's layout (`pack_pairs_bf16`): outputs in blocks of 16, k in pairs."""
    n, k = weight.shape
    weight = weight.contiguous()
    packed = weight.new_empty(-(-n // 16) * 16 * -(-k // 2) * 2)
    status = native.library().pack_pairs_bf16(weight.data_ptr(), n, k, weight.stride(0), packed.data_ptr())
    if status:
        raise RuntimeError(f"pack_pairs_bf16 failed with status {status} (weight {tuple(weight.shape)})")
    return packed


def _bf16_product(x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor, ...]):
    packed, bias = packed_weights.cached_pack(weights, biases, _pairs_layout)
    return native_linear_bf16(x, packed, sum(w.shape[0] for w in weights), bias)


def native_linear_bf16(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                       lib=None) -> torch.Tensor:
    """The bf16 kernel's `x @ weight.T (+ bias)` for `n` outputs, the weight packed by `pack_pairs_bf16`
    (of `lib`, another build of the kernels than the engine's, for tests, else the engine's)."""
    out = x.new_empty(x.shape[0], n)
    bias = None if bias is None else bias.contiguous()  # NOTE: held here, so alive through the call
    status = (lib or native.library()).small_gemm_bf16(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), packed.data_ptr(), n,
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads())
    if status:
        raise RuntimeError(f"small_gemm_bf16 failed with status {status} (x {tuple(x.shape)}, {n} outputs)")
    return out


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
