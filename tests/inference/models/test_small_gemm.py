"""The native decode-step GEMM against a float64 reference, and its batch invariance."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from inference import native
from inference.models import small_gemm
from inference.models.small_gemm import MAX_ROWS, few_rows, linear, native_linear

needs_kernels = pytest.mark.skipif(not native.available(), reason="native kernels not built")


@pytest.mark.parametrize("shape", [(576, 576), (192, 576), (1536, 576), (576, 1536), (37, 13), (5, 8), (3, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_close_to_float64_and_with_kernels_each_row_alike_at_every_row_count(shape, bias):
    # NOTE: MKL's sgemm (the fallback) rounds a row by the batch's shape
    _check_close_and_alike(linear, shape, bias, alike=native.available())


def _x86_levels() -> list[str]:
    """The x86-64 levels below AVX-512 this CPU has (none elsewhere)."""
    levels = []
    for level in ("v2", "v3"):  # NOTE: v4 is AVX-512, whose tiles a CPU with it builds natively
        try:
            native.checked_level(level)
        except ValueError:
            continue
        levels.append(level)
    return levels


@needs_kernels
@pytest.mark.parametrize("level", _x86_levels())
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (37, 13)])
@pytest.mark.parametrize("bias", [False, True])
def test_each_x86_level_s_tiles_are_checked_on_this_cpu(level, shape, bias):
    """Each level compiles its own tiles (SSE 1 x 4; AVX2 2 x 6 with 1 x 12 and 3 x 4 leftovers;
    AVX-512 3 x 8): the ones this CPU does not pick natively are checked here too."""
    lib = native.library_at(level)
    _check_close_and_alike(partial(native_linear, lib=lib), shape, bias, alike=True)


def _check_close_and_alike(gemm, shape, bias, alike):
    """`gemm` within a few ulps of float64 at `MAX_ROWS` rows; with `alike`, each row the same bits
    in any batch, wherever it falls in the kernel's tiles of rows."""
    out_f, in_f = shape
    g = torch.Generator().manual_seed(out_f * 7 + in_f)
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    x = torch.randn(MAX_ROWS, in_f + 3, generator=g)[:, :in_f]  # NOTE: a row stride past the width
    full = gemm(x, w, b)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    # fp32 sums of in_f products: a few ulps of the sum of magnitudes
    bound = 8 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T + 1)
    assert ((full.double() - exact).abs() <= bound).all()
    if alike:
        for rows in [*range(1, 10), 12, 16, 17, 24, 31, 40, 56, 64, 100, MAX_ROWS - 1, MAX_ROWS]:
            for offset in (0, 1, 2, 3, 5):
                end = offset + rows
                if end <= MAX_ROWS:
                    assert torch.equal(gemm(x[offset:end], w, b), full[offset:end]), (offset, rows)


@needs_kernels
def test_few_rows_take_the_kernel_and_others_the_packed_or_f_linear(monkeypatch):
    w = torch.randn(64, 32)
    assert few_rows(torch.randn(MAX_ROWS, 32), w)
    assert not few_rows(torch.randn(MAX_ROWS + 1, 32), w)
    assert not few_rows(torch.randn(4, 32, dtype=torch.float64), w.double())
    assert not few_rows(torch.randn(32, 4).T, w)  # columns not contiguous
    assert not few_rows(torch.randn(4, 32), torch.randn(32, 64).T)  # weight not contiguous
    calls = []
    monkeypatch.setattr(small_gemm.packed_weights, "linear", lambda *a: calls.append(a) or torch.zeros(1))
    linear(torch.randn(2, 32), w)
    assert not calls
    linear(torch.randn(MAX_ROWS + 1, 32), w)
    assert len(calls) == 1


@needs_kernels
def test_a_bad_shape_is_refused_by_the_kernel():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    y = torch.empty(2, 4)
    lib = native.library()
    assert lib.small_gemm_f32(x.data_ptr(), 0, 8, 8, w.data_ptr(), 4, None, y.data_ptr(), 4, 1) == 1  # no rows
    assert lib.small_gemm_f32(x.data_ptr(), 2, 8, 4, w.data_ptr(), 4, None, y.data_ptr(), 4, 1) == 1  # stride < k
    assert lib.small_gemm_f32(x.data_ptr(), 2, 8, 8, w.data_ptr(), 4, None, y.data_ptr(), 3, 1) == 1  # stride < n
