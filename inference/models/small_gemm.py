"""`linear` on CPU through native GEMMs: fp32 up to `MAX_ROWS` rows (`csrc/small_gemm.c`, MKL past
that), bf16 at every row count (`csrc/small_gemm_bf16.c`, on a pack of the weight made once); without
the kernels MKL in fp32 and oneDNN packs in bf16 (`packed_weights.py`).

A decode step carries from one row (the tail of a rollout batch) to a full batch, and MKL's
sgemm there runs below what the machine gives: at a few rows below the memory bandwidth its gemv
reaches at one row, at 16-32 rows below its matmul rate. The native kernel reads each weight once
per call and multiplies eight rows to a vector (SmolLM2-135M fp32, one thread, Zen 3: a decode
step of 16 / 32 / 64 rows 119-134 / 185-195 / 351-387 ms, with MKL's GEMMs 171 / 249-252 /
370-413; a step's GEMMs alone at one row 39 ms, MKL's 43-53). oneDNN's bf16 product likewise reads
weights at about half the bandwidth at a few rows; in a prefill's hundreds of rows both run at the
machine's bf16 matmul rate (the bf16 kernel's header has the figures), so bf16 keeps one kernel and
one pack per weight throughout.

The fp32 kernel has two row tiles that give the same bits, eight rows to a vector or sixteen to an
AVX-512 one; which runs faster is the CPU's (`f32_tile`, timed once per process, or forced by
`ROLLOUT_ENGINE_F32_TILE`).

Both kernels sum each output alike whatever the row count, so a row's outputs are the same bits
in a one-row step, in an eight-token verify step and in a full batch (speculation on and off then
agree bit for bit); in bf16 in a prefill too. Past `MAX_ROWS` fp32 rows MKL takes over, with its own
rounding, except inside `fixed_order()` (an engine's `batch_invariant` forward), where the fp32 kernel
takes every row count.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import statistics
import time
from collections.abc import Iterator

import torch

from inference import native
from inference.models import packed_weights

# fp32 up to here by the kernel. SmolLM2's step GEMMs, one thread, Zen 3: 128 rows 542 ms vs MKL 572, 256 rows
# 1016 / 1007; two threads, Zen 4 (30 layers, interleaved medians): 256 rows 11.1 ms a layer vs MKL 13.0
# (q/k/v 160 vs 137 GFLOP/s, gate/up 175 vs 135), a GRPO 32 x n=8 fp32 rollout 1.09x (two pairs)
MAX_ROWS = 256
# fp32's row kernels (`csrc/small_gemm.c`), the same bits: "narrow" (eight rows to a vector) or "wide" (sixteen
# to an AVX-512 vector, from 16 rows). Which is faster is the CPU's: full-width 512-bit FMA units (Zen 5,
# Intel's server cores) run the wide one up to twice as fast, split ones (Zen 4) the narrow one a little
# faster. `ROLLOUT_ENGINE_F32_TILE` = narrow | wide | auto (the default: timed once, on first use).
F32_TILES = ("narrow", "wide")
_f32_tile: str | None = None
# NOTE: a context variable, so one engine's batch-invariant forward does not change another thread's
_FIXED_ORDER: contextvars.ContextVar[bool] = contextvars.ContextVar("small_gemm_fixed_order", default=False)


@contextlib.contextmanager
def fixed_order() -> Iterator[None]:
    """Within it (on this thread), fp32 products take the native kernel at any row count: each row's
    outputs the same bits whatever the batch (`InferenceConfig.batch_invariant`)."""
    token = _FIXED_ORDER.set(True)
    try:
        yield
    finally:
        _FIXED_ORDER.reset(token)


def f32_tile() -> str:
    """The fp32 row kernel this process uses (see `F32_TILES`), chosen on the first call."""
    global _f32_tile
    if _f32_tile is None:
        _f32_tile = _choose_f32_tile()
    return _f32_tile


def set_f32_tile(tile: str | None) -> None:
    """Use `tile` from now on (tests force each); None: choose again on the next call."""
    global _f32_tile
    if tile is not None and tile not in F32_TILES:
        raise ValueError(f"fp32 tile {tile!r}: expected one of {F32_TILES}")
    _f32_tile = tile


def _choose_f32_tile() -> str:
    asked = os.environ.get("ROLLOUT_ENGINE_F32_TILE", "auto").strip().lower() or "auto"
    if asked in F32_TILES:
        return asked
    if asked != "auto":
        raise ValueError(f"ROLLOUT_ENGINE_F32_TILE={asked!r}: expected narrow, wide or auto")
    if not (native.available() and native.library().small_gemm_f32_has_wide()):
        return "narrow"
    # NOTE: both give the same bits, so a noisy timing costs speed at worst: a gate/up-sized product at
    # 64 rows (~0.1 GFLOP, a few ms for both), interleaved, the median of five each. Its data from a
    # generator of its own: torch's global one is the caller's (a seeded trainer's stream must not move)
    numbers = torch.Generator().manual_seed(0)
    x, weight = torch.randn(64, 576, generator=numbers), torch.randn(1536, 576, generator=numbers)
    seconds: dict[str, list[float]] = {tile: [] for tile in F32_TILES}
    for repeat in range(7):
        for tile in F32_TILES:
            start = time.perf_counter()
            native_linear(x, weight, tile=tile)
            if repeat >= 2:  # NOTE: the first calls grow each kernel's packing buffer
                seconds[tile].append(time.perf_counter() - start)
    return "wide" if statistics.median(seconds["wide"]) < statistics.median(seconds["narrow"]) else "narrow"


def takes_native(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear(x, weight, bias)` takes a native kernel: fp32 up to `MAX_ROWS` rows, bf16 any."""
    if not (x.dim() == 2 and x.shape[0] >= 1 and x.device.type == "cpu" and x.stride(1) == 1
            and weight.device.type == "cpu" and weight.dim() == 2 and native.available()):
        return False
    if x.dtype == torch.bfloat16:  # NOTE: the kernel reads a pack, made from any layout of the weight
        return (weight.dtype == torch.bfloat16 and (bias is None or bias.dtype == torch.bfloat16)
                and not (weight.requires_grad and torch.is_grad_enabled()))  # NOTE: no backward
    return ((x.shape[0] <= MAX_ROWS or _FIXED_ORDER.get()) and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through a native kernel where `takes_native` (module docstring), else
    `packed_weights.linear`."""
    if takes_native(x, weight, bias):
        if x.dtype == torch.bfloat16:
            return _bf16_product(x, (weight,), () if bias is None else (bias,))
        return native_linear(x, weight, bias)
    return packed_weights.linear(x, weight, bias)


def linear_group(x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                 biases: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
    """`x` times the weights side by side, `[rows, sum of their rows]` (q, k and v; gate and up), in one
    call on one pack (each output the same bits as its own `linear`): bf16 only, through the native
    kernel, else `packed_weights.linear_group`; None where neither takes them (the caller multiplies
    each weight on its own)."""
    if x.dtype == torch.bfloat16 and all(takes_native(x, w, b) for w, b in zip(weights, biases)):
        with_bias = [b is not None for b in biases]
        if any(with_bias) != all(with_bias):
            return None
        return _bf16_product(x, tuple(weights), tuple(biases) if all(with_bias) else ())
    return packed_weights.linear_group(x, weights, biases)


def pairs_pack(weight: torch.Tensor, lib=None) -> torch.Tensor:
    """`weight [n, k]` in the bf16 kernel's layout (`pack_pairs_bf16`): outputs in blocks of 16, k in
    pairs; `lib`: another build of the kernels (whose layout it is), for tests, else the engine's."""
    n, k = weight.shape
    weight = weight.contiguous()
    packed = weight.new_empty(-(-n // 16) * 16 * -(-k // 2) * 2)
    status = (lib or native.library()).pack_pairs_bf16(weight.data_ptr(), n, k, weight.stride(0), packed.data_ptr())
    if status:
        raise RuntimeError(f"pack_pairs_bf16 failed with status {status} (weight {tuple(weight.shape)})")
    return packed


def _bf16_product(x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor, ...]):
    packed, bias = packed_weights.cached_pack(weights, biases, pairs_pack)
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


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, lib=None,
                  tile: str | None = None) -> torch.Tensor:
    """The native kernel's `x @ weight.T (+ bias)`, for fp32 inputs `takes_native` accepts; `lib`: another build
    of the kernels than the engine's (`native.library_at`), for tests; `tile`: the row kernel (`F32_TILES`),
    else this process's (`f32_tile`)."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    lib = lib or native.library()
    kernel = lib.small_gemm_f32_wide if (tile or f32_tile()) == "wide" else lib.small_gemm_f32
    status = kernel(
        x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(), weight.shape[0],
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads())
    if status:
        raise RuntimeError(f"small_gemm_f32 failed with status {status} "
                           f"(x {tuple(x.shape)}, weight {tuple(weight.shape)})")
    return out
