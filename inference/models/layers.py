"""The maths of a Llama-family block as pure functions over weight tensors.

Each function reproduces HF transformers' op order and dtypes (e.g. RMSNorm normalises in fp32
and casts back before the weight multiply), so fp32 parity is exact up to kernel rounding and
low-precision runs round the way HF does.
"""

from __future__ import annotations

import math
import platform
from functools import lru_cache

import torch
import torch.nn.functional as F

from inference import native
from inference.models.small_gemm import linear, linear_group, takes_native
from inference.models.spec import RopeKind, RopeSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * normalize(x)` over the last dim; statistics in fp32 like HF's `LlamaRMSNorm`.

    NOTE: float32 on the CPU runs the native kernel (`csrc/add_rms_norm.c`, with no residual): one
    pass per row, the same bits as `F.rms_norm`, whose seven ops cost ~190 us on a decode step's
    32 x 576 (the kernel: a few us); elsewhere `F.rms_norm`. In bf16 / fp16, HF's order (normalize
    in fp32, cast, then times the weight) keeps its casts: in bf16 the native kernel does all of it
    in one pass, rounding as the torch ops do; elsewhere the fp32 kernel normalizes (times ones:
    exact) in place of `F.rms_norm`'s ops.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        out = _native_rms_norm(x, weight, eps)
        # in fp32 there is no intermediate cast for HF's op order to differ on
        return out if out is not None else F.rms_norm(x, (x.shape[-1],), weight=weight, eps=eps)
    out = _native_bf16_norm(x, None, weight, eps)
    if out is not None:
        return out
    xf = x.float()
    normed = _native_rms_norm(xf, _ones(x.shape[-1]), eps)
    if normed is None:
        normed = F.rms_norm(xf, (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The native kernel's RMSNorm of fp32 `x` times fp32 `weight` (the same bits as `F.rms_norm`),
    or None where the kernel does not take them (`native_norm_lanes`)."""
    lanes = native_norm_lanes(x, weight)
    if lanes is None:
        return None
    out = torch.empty_like(x)
    status = native.library().rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                           x.numel() // x.shape[-1], x.shape[-1], eps, lanes, torch.get_num_threads())
    if status:
        raise RuntimeError(f"rms_norm_f32 failed with status {status} (hidden {x.shape[-1]}, lanes {lanes})")
    return out


@lru_cache(maxsize=8)
def _ones(n: int) -> torch.Tensor:
    return torch.ones(n)


def native_norm_lanes(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> int | None:
    """The lanes of torch's float sum (see `torch_sum_lanes`) where the native norm kernels take `x`
    (`dtype`, CPU, contiguous, rows of at least that many elements) and `weight`; else None."""
    n = x.shape[-1]
    lanes = torch_sum_lanes()
    if (lanes is None or x.device.type != "cpu" or x.dtype != dtype or weight.dtype != dtype
            or n < lanes or weight.shape != (n,) or not x.is_contiguous() or not weight.is_contiguous()
            or not native.available()):
        return None
    return lanes


BF16_NORM_MAX_HIDDEN = 32768  # the kernel's row on its stack (`MAX_BF16_ROW` in csrc/add_rms_norm.c)


def _native_bf16_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> torch.Tensor | None:
    """bf16 `rms_norm(x, weight, eps)`, `x += residual` first unless None, in one native pass (HF's
    op order, each op rounded as torch rounds it: the same bits); None where the kernel does not
    take them."""
    lanes = native_norm_lanes(x, weight, torch.bfloat16)
    if lanes is None or x.shape[-1] > BF16_NORM_MAX_HIDDEN or (residual is not None and (
            residual.dtype != torch.bfloat16 or residual.shape != x.shape or not residual.is_contiguous())):
        return None
    out = torch.empty_like(x)
    status = native.library().add_rms_norm_bf16(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        x.numel() // x.shape[-1], x.shape[-1], eps, lanes, torch.get_num_threads())
    if status:
        raise RuntimeError(f"add_rms_norm_bf16 failed with status {status} (hidden {x.shape[-1]}, lanes {lanes})")
    return out


@lru_cache(maxsize=1)
def torch_sum_lanes() -> int | None:
    """The float lanes of the `Vectorized` torch's CPU float sum runs with (its reduction order), or None.

    NOTE: known on x86-64 only: 8 under every capability. The default build's `Vectorized` is 32
    bytes like AVX2's, and torch registers no AVX512 sum kernel (an AVX512 CPU runs the AVX2 one;
    torch 2.13 here: a 16-lane order misses torch's sums, the 8-lane one matches them).
    """
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return 8 if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2", "DEFAULT") else None


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x += residual`, then `rms_norm(x, weight, eps)`; `x` is the caller's (a projection's fresh output).

    NOTE: float32 on the CPU runs the native kernel (`csrc/add_rms_norm.c`): one pass per row instead
    of torch's add and rms_norm's seven ops (pow, sum, fill, div, add, rsqrt, two muls), each step
    rounded as torch rounds it and the sum of squares in torch's order, so `x` and the result are
    the same bit for bit; in bf16 likewise (`_native_bf16_norm`). Elsewhere (and under
    ROLLOUT_ENGINE_NO_KERNELS) it is those torch ops.
    """
    n = x.shape[-1]
    lanes = native_norm_lanes(x, weight)
    if (lanes is not None and residual.dtype == torch.float32 and x.dim() == 2 and residual.shape == x.shape
            and residual.is_contiguous()):
        out = torch.empty_like(x)
        status = native.library().add_rms_norm_f32(x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                                                    out.data_ptr(), x.shape[0], n, eps, lanes,
                                                    torch.get_num_threads())
        if status:
            raise RuntimeError(f"add_rms_norm_f32 failed with status {status} (hidden {n}, lanes {lanes})")
        return out
    out = _native_bf16_norm(x, residual, weight, eps)
    return out if out is not None else rms_norm(x.add_(residual), weight, eps)


def swiglu(
    x: torch.Tensor,
    gate_w: torch.Tensor,
    up_w: torch.Tensor,
    down_w: torch.Tensor,
    gate_b: torch.Tensor | None = None,
    up_b: torch.Tensor | None = None,
    down_b: torch.Tensor | None = None,
) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))`. Separate gate/up weights: a fused copy would break aliasing
    (bf16 on CPU multiplies one pack of both, `small_gemm.linear_group`, rebuilt whenever either is written).

    NOTE: silu and the product run in place on the gate projection's output (the same values as
    the out-of-place ops, without two `[T, intermediate]` temporaries per layer).
    """
    both = linear_group(x, (gate_w, up_w), (gate_b, up_b))
    if both is not None:  # NOTE: bf16 on CPU: gate and up in one call, views of one output
        gate, up = both.split(gate_w.shape[0], dim=-1)
        return linear(F.silu(gate, inplace=True).mul_(up), down_w, down_b)
    act = F.silu(linear(x, gate_w, gate_b), inplace=True)
    return linear(act.mul_(linear(x, up_w, up_b)), down_w, down_b)


# rows of the LM head weight per GEMM call on CPU (see `lm_head`)
LM_HEAD_CHUNK = 1024


def lm_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Logits `x @ weight.T` `[R, vocab]`.

    NOTE: on CPU in fp32 the GEMM runs over `LM_HEAD_CHUNK` vocabulary rows at a time, written
    into one output: MKL's sgemm over the whole `[vocab, hidden]` weight at decode batch sizes
    runs at ~60% of the rate it gives the model's other GEMMs (SmolLM2, 64 rows, one thread:
    69 -> 51 ms). A chunk's dot products are the same ones, bit for bit (tested against
    `F.linear`), so the logits are unchanged. At decode batch sizes (up to `small_gemm.MAX_ROWS`
    rows) the native GEMM runs instead (`small_gemm.linear`: faster there, its own rounding, the
    same bits at every row count).
    """
    if (takes_native(x, weight)  # NOTE: fp32 at a decode step's rows, bf16 always: a native kernel (small_gemm.py)
            or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 2):
        return linear(x, weight)
    vocab = weight.shape[0]
    out = x.new_empty(x.shape[0], vocab)
    for start in range(0, vocab, LM_HEAD_CHUNK):
        rows = weight[start: start + LM_HEAD_CHUNK]
        torch.mm(x, rows.t(), out=out[:, start: start + rows.shape[0]])
    return out


def rope_inv_freq(rope: RopeSpec, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` (fp32), including linear / llama3 scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind is RopeKind.LINEAR:
        return inv_freq / rope.factor
    if rope.kind is RopeKind.LLAMA3:
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    """Computes cos/sin for a step's positions; applied in place of HF's `apply_rotary_pos_emb`.

    cos/sin are computed once per step (not per layer) in fp32 from the positions and cast to
    the model dtype, as HF does. The table is not cached: `T * D / 2` trig ops per step are
    negligible next to the projections and keep long-context memory flat.
    """

    __slots__ = ("inv_freq",)

    def __init__(self, rope: RopeSpec, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.inv_freq = rope_inv_freq(rope, head_dim, device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)`, each `[T, 1, head_dim]` so they broadcast over heads."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, H, D]` by the step's angles (HF's rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` of `x`, which the caller owns (a projection's fresh output) and may find rotated.

    NOTE: float32 and bf16 on the CPU run the native kernel (`csrc/rotary.c`): one pass instead of
    torch's neg, cat, two products and a sum, each product and the sum rounded as torch rounds them,
    so the result is the same bit for bit. Elsewhere (and under ROLLOUT_ENGINE_NO_KERNELS) it is
    `apply_rotary`, out of place.
    """
    tokens, heads, dim = x.shape
    kernel = _ROTARY_KERNELS.get(x.dtype)
    if (kernel is not None and x.device.type == "cpu" and cos.dtype == x.dtype and sin.dtype == x.dtype
            and x.stride(2) == 1 and x.stride(1) == dim and cos.is_contiguous() and sin.is_contiguous()
            and cos.numel() == tokens * dim and native.available()):
        status = getattr(native.library(), kernel)(x.data_ptr(), tokens, heads, dim, x.stride(0), cos.data_ptr(),
                                                   sin.data_ptr(), torch.get_num_threads())
        if status:
            raise RuntimeError(f"{kernel} failed with status {status} (head_dim {dim})")
        return x
    return apply_rotary(x, cos, sin)


_ROTARY_KERNELS = {torch.float32: "rotary_f32", torch.bfloat16: "rotary_bf16"}
