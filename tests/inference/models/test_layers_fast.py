"""The CPU fast paths of the layers give the reference ops' results bit for bit: the chunked LM head
(`F.linear`), the in-place rotary (`apply_rotary`; native kernel unless ROLLOUT_ENGINE_NO_KERNELS) and
the RMSNorm and the fused residual add + RMSNorm (`F.rms_norm`, `add_` then `F.rms_norm`; native kernel
and torch path both)."""

import pytest
import torch
import torch.nn.functional as F

from inference import native
from inference.models import small_gemm
from inference.models.layers import (
    LM_HEAD_CHUNK,
    RotaryEmbedding,
    add_rms_norm_,
    apply_rotary,
    apply_rotary_,
    lm_head,
    rms_norm,
    torch_sum_lanes,
)
from inference.models.spec import RopeSpec
from tests.inference.native_util import SWITCH, kernels_on


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 129])
@pytest.mark.parametrize("vocab,hidden", [(LM_HEAD_CHUNK * 3 + 17, 576), (32000, 256), (LM_HEAD_CHUNK - 5, 64)])
def test_lm_head_equals_linear(rows: int, vocab: int, hidden: int) -> None:
    """Bit for bit: F.linear's own products, or (a few rows, kernels built) the few-row GEMM's."""
    gen = torch.Generator().manual_seed(rows * vocab)
    x, w = torch.randn(rows, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen)
    assert torch.equal(lm_head(x, w), small_gemm.linear(x, w) if small_gemm.takes_native(x, w) else F.linear(x, w))


def test_lm_head_in_bf16_is_small_gemm_s_linear() -> None:
    """bf16: the native kernel's bits where built (within a rounding of F.linear's), else F.linear's own."""
    x, w = torch.randn(4, 32).bfloat16(), torch.randn(3000, 32).bfloat16()
    assert torch.equal(lm_head(x, w), small_gemm.linear(x, w))
    assert torch.allclose(lm_head(x, w).float(), F.linear(x, w).float(), rtol=2 ** -7, atol=1e-2)


@pytest.mark.parametrize("tokens,heads,dim", [(1, 3, 64), (64, 9, 64), (200, 4, 64), (5, 2, 128), (0, 2, 64)])
def test_rotary_in_place_equals_apply_rotary(tokens: int, heads: int, dim: int) -> None:
    rotary = RotaryEmbedding(RopeSpec(theta=100000.0), dim)
    gen = torch.Generator().manual_seed(tokens * heads + dim)
    cos, sin = rotary.cos_sin(torch.randint(0, 8192, (tokens,), generator=gen), torch.float32)
    x = torch.randn(tokens, heads * dim, generator=gen).view(tokens, heads, dim)
    want = apply_rotary(x, cos, sin)
    assert torch.equal(apply_rotary_(x.clone(), cos, sin), want)


@pytest.fixture(params=["native", "torch"])
def kernel_setting(request, monkeypatch):
    """Each test runs with the native kernels and without them (ROLLOUT_ENGINE_NO_KERNELS)."""
    if request.param == "native":
        if native.compiler() is None:
            pytest.skip("no C compiler on this machine")
        with kernels_on():
            yield request.param
        return
    monkeypatch.setenv(SWITCH, "1")
    native.library.cache_clear()
    try:
        assert not native.available()
        yield request.param
    finally:
        monkeypatch.delenv(SWITCH)
        native.library.cache_clear()


@pytest.mark.parametrize("rows", [0, 1, 3, 64, 129])
@pytest.mark.parametrize("hidden", [576, 256, 960, 100, 17, 4])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 40.0])
def test_add_rms_norm_equals_add_then_rms_norm(kernel_setting: str, rows: int, hidden: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(rows * hidden + int(scale * 10))
    x, residual = torch.randn(rows, hidden, generator=gen) * scale, torch.randn(rows, hidden, generator=gen) * scale
    weight = torch.randn(hidden, generator=gen)
    summed = x.clone()
    want = F.rms_norm(summed.add_(residual), (hidden,), weight=weight, eps=1e-5)
    got = add_rms_norm_(x, residual, weight, 1e-5)
    assert torch.equal(x, summed) and torch.equal(got, want)


def test_add_rms_norm_with_two_threads(kernel_setting: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # NOTE: 129 x 576 crosses the kernel's threshold for an OpenMP team
    try:
        test_add_rms_norm_equals_add_then_rms_norm(kernel_setting, 129, 576, 1.0)
    finally:
        torch.set_num_threads(threads)


def test_add_rms_norm_other_dtypes_fall_back() -> None:
    x, residual, weight = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16(), torch.randn(64).bfloat16()
    summed = x.clone().add_(residual)
    want = weight * F.rms_norm(summed.float(), (64,), eps=1e-6).bfloat16()
    assert torch.equal(add_rms_norm_(x, residual, weight, 1e-6), want) and torch.equal(x, summed)


@pytest.mark.parametrize("shape", [(0, 576), (1, 576), (32, 576), (129, 960), (7, 100), (5, 17), (3, 4), (6, 9, 64)])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 40.0])
def test_rms_norm_equals_torch(kernel_setting: str, shape: tuple, scale: float) -> None:
    """Bit for bit F.rms_norm, rows of any width and a [tokens, heads, head_dim] input (q/k norms);
    the input is left as it was."""
    gen = torch.Generator().manual_seed(sum(shape) + int(scale * 10))
    x, weight = torch.randn(*shape, generator=gen) * scale, torch.randn(shape[-1], generator=gen)
    before = x.clone()
    got = rms_norm(x, weight, 1e-6)
    assert torch.equal(got, F.rms_norm(before, (shape[-1],), weight=weight, eps=1e-6)) and torch.equal(x, before)


@pytest.mark.parametrize("shape", [(1, 576), (32, 576), (129, 960), (7, 100), (3, 4), (6, 9, 64)])
def test_bf16_rms_norm_keeps_hfs_op_order_bit_for_bit(kernel_setting: str, shape: tuple) -> None:
    """In bf16 (HF's `LlamaRMSNorm`: normalize in fp32, cast, then times the weight) the native
    kernel normalizes, times ones: the same bits as the torch ops, kernels or not."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 3).bfloat16()
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).bfloat16()
    want = weight * F.rms_norm(x.float(), (shape[-1],), eps=1e-5).bfloat16()
    assert torch.equal(rms_norm(x, weight, 1e-5), want)


def test_rms_norm_of_a_strided_view_falls_back(kernel_setting: str) -> None:
    x, weight = torch.randn(8, 64)[:, :32], torch.randn(32)
    assert torch.equal(rms_norm(x, weight, 1e-5), F.rms_norm(x, (32,), weight=weight, eps=1e-5))


# ---- bf16: the native kernels round as torch's bf16 ops do, at every x86-64 level ------------------


def _bf16_rotary_inputs(tokens: int, heads: int, dim: int, width: int):
    """q as a column slice of a wider projection output (row stride `width`), and its cos / sin."""
    rotary = RotaryEmbedding(RopeSpec(theta=100000.0), dim)
    gen = torch.Generator().manual_seed(tokens * heads + dim + width)
    cos, sin = rotary.cos_sin(torch.randint(0, 8192, (tokens,), generator=gen), torch.bfloat16)
    wide = (torch.randn(tokens, width, generator=gen) * 4).bfloat16()
    return wide, wide[:, : heads * dim].view(tokens, heads, dim), cos, sin


@pytest.mark.parametrize("tokens,heads,dim,width", [(1, 3, 64, 192), (64, 9, 64, 960), (200, 4, 64, 256),
                                                    (5, 2, 128, 300), (0, 2, 64, 128)])
def test_bf16_rotary_in_place_equals_apply_rotary(kernel_setting: str, tokens: int, heads: int, dim: int,
                                                  width: int) -> None:
    wide, x, cos, sin = _bf16_rotary_inputs(tokens, heads, dim, width)
    rest = wide[:, heads * dim:].clone()
    want = apply_rotary(x.clone(), cos, sin)
    assert torch.equal(apply_rotary_(x, cos, sin), want)  # NOTE: in place with the kernel, out of place without
    assert torch.equal(wide[:, heads * dim:], rest)  # the columns beside q are not written


@pytest.mark.parametrize("rows", [0, 1, 3, 64, 129])
@pytest.mark.parametrize("hidden", [576, 960, 100, 17])
@pytest.mark.parametrize("scale", [1.0, 1e-3, 40.0])
def test_bf16_add_rms_norm_equals_add_then_hfs_rms_norm(kernel_setting: str, rows: int, hidden: int,
                                                        scale: float) -> None:
    gen = torch.Generator().manual_seed(rows * hidden + int(scale * 10))
    x = (torch.randn(rows, hidden, generator=gen) * scale).bfloat16()
    residual = (torch.randn(rows, hidden, generator=gen) * scale).bfloat16()
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).bfloat16()
    summed = x.clone().add_(residual)
    want = weight * F.rms_norm(summed.float(), (hidden,), eps=1e-5).bfloat16()
    got = add_rms_norm_(x, residual, weight, 1e-5)
    assert torch.equal(x, summed) and torch.equal(got, want)


def _level_library(level: str):
    if native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    try:
        return native.library_at(level)
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("level", ["v2", "v3", "v4"])
def test_bf16_kernels_round_as_torch_at_every_level(level: str) -> None:
    """Built for each x86-64 level (another CPU's vector width), the bf16 rotary and norm kernels
    still give torch's bits: their ops are rounded one by one, the norm's sum in torch's order."""
    lib = _level_library(level)
    lanes = torch_sum_lanes()
    if lanes is None:
        pytest.skip("torch's sum order is known on x86-64 only")
    wide, x, cos, sin = _bf16_rotary_inputs(64, 9, 64, 960)
    want = apply_rotary(x.clone(), cos, sin)
    assert lib.rotary_bf16(x.data_ptr(), 64, 9, 64, 960, cos.data_ptr(), sin.data_ptr(), 2) == 0
    assert torch.equal(x, want)
    gen = torch.Generator().manual_seed(7)
    h, r = (torch.randn(129, 576, generator=gen) * 3).bfloat16(), (torch.randn(129, 576, generator=gen) * 3).bfloat16()
    weight = (1 + 0.2 * torch.randn(576, generator=gen)).bfloat16()
    summed = h.clone().add_(r)
    want = weight * F.rms_norm(summed.float(), (576,), eps=1e-6).bfloat16()
    out = torch.empty_like(h)
    assert lib.add_rms_norm_bf16(h.data_ptr(), r.data_ptr(), weight.data_ptr(), out.data_ptr(), 129, 576, 1e-6,
                                 lanes, 2) == 0
    assert torch.equal(h, summed) and torch.equal(out, want)
