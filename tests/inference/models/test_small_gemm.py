"""The native decode-step GEMMs (fp32 and bf16) against a float64 reference, and their batch invariance."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from inference import native
from inference.models import packed_weights, small_gemm
from inference.models.small_gemm import MAX_ROWS, linear, linear_group, native_linear, takes_native

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
@pytest.mark.parametrize("tile", small_gemm.F32_TILES)
@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (37, 13), (3, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_each_row_kernel_is_close_and_each_row_alike(tile, shape, bias):
    """Both row kernels (eight rows to a vector, sixteen to an AVX-512 one) forced, whichever this CPU picks."""
    _check_close_and_alike(partial(native_linear, tile=tile), shape, bias, alike=True)


@needs_kernels
@pytest.mark.parametrize("level", ["native", *_x86_levels()])
def test_fp32_row_kernels_give_the_same_bits(level):
    """The wide kernel's lanes are rows, each summed as the narrow kernel sums it: the same bits at every
    row count (padding of its sixteen-row groups, the narrow kernel below 16 rows), k and n off its
    tiles, a row stride past the width; a build without AVX-512 runs the narrow one under both names."""
    lib = native.library() if level == "native" else native.library_at(level)
    g = torch.Generator().manual_seed(5)
    for out_f, in_f in [(576, 576), (192, 576), (37, 70), (49, 9)]:
        w, b = torch.randn(out_f, in_f, generator=g), torch.randn(out_f, generator=g)
        x = torch.randn(MAX_ROWS + 4, in_f + 5, generator=g)[:, :in_f]
        for rows in [1, 4, 5, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 100, MAX_ROWS, MAX_ROWS + 4]:
            for bias in (None, b):
                narrow = native_linear(x[:rows], w, bias, lib=lib, tile="narrow")
                assert torch.equal(native_linear(x[:rows], w, bias, lib=lib, tile="wide"), narrow), (out_f, rows)


@needs_kernels
def test_fp32_tile_is_chosen_once_forced_by_the_environment_or_a_call(monkeypatch):
    try:
        for asked in small_gemm.F32_TILES:
            monkeypatch.setenv("ROLLOUT_ENGINE_F32_TILE", asked)
            small_gemm.set_f32_tile(None)
            assert small_gemm.f32_tile() == asked
        monkeypatch.setenv("ROLLOUT_ENGINE_F32_TILE", "auto")
        small_gemm.set_f32_tile(None)
        state = torch.get_rng_state()
        chosen = small_gemm.f32_tile()
        assert torch.equal(torch.get_rng_state(), state)  # NOTE: the timing draws from no caller's generator
        assert chosen in small_gemm.F32_TILES and small_gemm.f32_tile() == chosen  # NOTE: timed once, then kept
        if not native.library().small_gemm_f32_has_wide():
            assert chosen == "narrow"
        monkeypatch.setenv("ROLLOUT_ENGINE_F32_TILE", "widest")
        small_gemm.set_f32_tile(None)
        with pytest.raises(ValueError, match="ROLLOUT_ENGINE_F32_TILE"):
            small_gemm.f32_tile()
        with pytest.raises(ValueError, match="fp32 tile"):
            small_gemm.set_f32_tile("widest")
        small_gemm.set_f32_tile("wide")
        x, w = torch.randn(40, 32), torch.randn(24, 32)
        assert torch.equal(linear(x, w), native_linear(x, w, tile="narrow"))
    finally:
        monkeypatch.delenv("ROLLOUT_ENGINE_F32_TILE")
        small_gemm.set_f32_tile(None)


@needs_kernels
def test_fp32_up_to_max_rows_takes_the_kernel_and_more_rows_the_packed_or_f_linear(monkeypatch):
    w = torch.randn(64, 32)
    assert takes_native(torch.randn(MAX_ROWS, 32), w)
    assert not takes_native(torch.randn(MAX_ROWS + 1, 32), w)
    assert not takes_native(torch.randn(4, 32, dtype=torch.float64), w.double())
    assert not takes_native(torch.randn(32, 4).T, w)  # columns not contiguous
    assert not takes_native(torch.randn(4, 32), torch.randn(32, 64).T)  # weight not contiguous
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
    x = torch.randn(32, 8)
    y = torch.empty(32, 4)
    assert lib.small_gemm_f32_wide(x.data_ptr(), 32, 8, 4, w.data_ptr(), 4, None, y.data_ptr(), 4, 1) == 1
    assert lib.small_gemm_f32_wide(x.data_ptr(), 32, 8, 8, w.data_ptr(), 4, None, y.data_ptr(), 3, 1) == 1


@needs_kernels
@pytest.mark.parametrize("level", ["native", *_x86_levels()])
@pytest.mark.parametrize("tile", small_gemm.F32_TILES)
def test_fp32_outputs_land_in_their_rows_of_a_wider_y_and_nothing_between(level, tile):
    """A task's rows are staged, then copied out a row at a time (`copy_out`): into a y whose rows are
    wider than n, each output lands at its row and column, and the gap after each row stays as it was."""
    lib = native.library() if level == "native" else native.library_at(level)
    kernel = lib.small_gemm_f32_wide if tile == "wide" else lib.small_gemm_f32
    g = torch.Generator().manual_seed(11)
    n, k, gap = 45, 70, 19
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for rows in (3, 8, 20, 50, 97):
        x = torch.randn(rows, k, generator=g)
        y = torch.full((rows, n + gap), 7.0)
        assert kernel(x.data_ptr(), rows, k, k, w.data_ptr(), n, b.data_ptr(), y.data_ptr(), y.stride(0), 2) == 0
        assert torch.equal(y[:, :n], native_linear(x, w, b, lib=lib, tile=tile)), rows
        assert (y[:, n:] == 7.0).all(), rows


@needs_kernels
@pytest.mark.parametrize("tile", small_gemm.F32_TILES)
def test_fp32_an_output_past_32_mb_asked_for_huge_pages_is_the_same_products(tile):
    """An output of 32 MB or more (the LM head's from 171 rows) is hinted to take huge pages before the
    kernel writes it (`advise_huge`): a hint only, the products the same bits as in smaller calls."""
    g = torch.Generator().manual_seed(13)
    rows, n, k = 180, 49152, 8
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    full = native_linear(x, w, tile=tile)
    assert full.numel() * 4 >= 32 << 20
    torch.testing.assert_close(full.double(), x.double() @ w.double().T, atol=1e-5, rtol=0)
    for start in range(0, rows, 60):
        assert torch.equal(native_linear(x[start:start + 60], w, tile=tile), full[start:start + 60]), start


# ---- bf16 ------------------------------------------------------------------------------------------

BF16_SHAPES = [(576, 576), (960, 576), (576, 1536), (37, 13), (49, 3), (16, 1), (5, 8)]


def _bf16_case(shape, bias, rows=MAX_ROWS):
    out_f, in_f = shape
    g = torch.Generator().manual_seed(out_f * 11 + in_f)
    w = torch.randn(out_f, in_f, generator=g).bfloat16()
    b = torch.randn(out_f, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, in_f + 3, generator=g).bfloat16()[:, :in_f]  # NOTE: a row stride past the width
    return x, w, b


def _pairs_gemm(lib):
    """`x @ w.T + b` by `lib`'s bf16 kernel on `lib`'s own pack."""
    def gemm(x, w, b=None):
        return small_gemm.native_linear_bf16(x, small_gemm.pairs_pack(w, lib), w.shape[0], b, lib=lib)
    return gemm


@needs_kernels
@pytest.mark.parametrize("shape", BF16_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_within_its_rounding_of_float64_and_each_row_alike_at_every_row_count(shape, bias):
    x, w, b = _bf16_case(shape, bias)
    full = linear(x, w, b)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    # fp32 sums of exact products (a few ulps of the sum of magnitudes), then one rounding to bf16
    sums = 8 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T + 1)
    bound = exact.abs() * 2.0 ** -8 + sums * (1 + 2.0 ** -8)
    assert full.dtype == torch.bfloat16 and ((full.double() - exact).abs() <= bound).all()
    for rows in [*range(1, 10), 16, 17, 23, 24, 25, 31, 40, 64, 100, MAX_ROWS - 1, MAX_ROWS]:
        for offset in (0, 1, 3, 7):
            if offset + rows <= MAX_ROWS:
                assert torch.equal(linear(x[offset:offset + rows], w, b), full[offset:offset + rows]), (offset, rows)


@needs_kernels
@pytest.mark.parametrize("level", [*_x86_levels(), "v4"])
@pytest.mark.parametrize("shape", [(960, 576), (37, 13), (49, 3)])
def test_bf16_every_build_gives_the_engine_s_bits(level, shape):
    """VDPBF16PS (AVX-512 BF16) where the CPU has it, fp32 multiply-adds in its order elsewhere: every
    build of the kernels gives the same bits (on a CPU without it this checks the other tiles)."""
    try:
        lib = native.library_at(level)
    except ValueError:
        pytest.skip(f"this CPU lacks x86-64-{level}")
    x, w, b = _bf16_case(shape, True, rows=40)
    assert torch.equal(_pairs_gemm(lib)(x, w, b), linear(x, w, b))
    assert torch.equal(_pairs_gemm(lib)(x[:3], w), linear(x[:3], w))


@needs_kernels
def test_bf16_takes_the_kernel_at_every_row_count_on_one_pack_repacked_when_written():
    x, w, b = _bf16_case((64, 32), True, rows=700)  # NOTE: a prefill's rows, past fp32's MAX_ROWS
    packed_weights.forget_all()
    full = linear(x, w, b)
    assert takes_native(x, w, b) and len(packed_weights._packs) == 1  # NOTE: no oneDNN pack beside it
    for rows, offset in ((1, 0), (9, 3), (MAX_ROWS + 5, 17), (300, 400)):
        assert torch.equal(linear(x[offset:offset + rows], w, b), full[offset:offset + rows]), (offset, rows)
    assert len(packed_weights._packs) == 1
    exact = x.double() @ w.double().T + b.double()
    assert (full.double() - exact).abs().max() <= (F.linear(x, w, b).double() - exact).abs().max() * 1.5
    with torch.no_grad():
        w.mul_(2)  # NOTE: a weight written in place is packed again
    assert torch.equal(linear(x[:2], w, b), _pairs_gemm(native.library())(x[:2], w, b))
    packed_weights.forget_all()


@needs_kernels
def test_bf16_group_is_each_weight_s_own_bits_side_by_side():
    x, q, _ = _bf16_case((48, 40), False, rows=9)
    _, k, kb = _bf16_case((20, 40), True)
    _, v, vb = _bf16_case((20, 40), True)
    qb = torch.randn(48).bfloat16()
    both = linear_group(x, (q, k, v), (qb, kb, vb))
    assert torch.equal(both, torch.cat([linear(x, q, qb), linear(x, k, kb), linear(x, v, vb)], dim=1))
    assert linear_group(x, (q, k), (None, kb)) is None  # NOTE: some with a bias: each on its own
    assert linear_group(x.float(), (q.float(), k.float()), (None, None)) is None  # NOTE: fp32: each on its own
    assert torch.equal(linear_group(x, (k, v), (None, None)), torch.cat([linear(x, k), linear(x, v)], dim=1))


@needs_kernels
def test_bf16_a_bad_shape_is_refused_by_the_kernel():
    x, w = torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    y = torch.empty(2, 4).bfloat16()
    lib = native.library()
    assert lib.small_gemm_bf16(x.data_ptr(), 0, 8, 8, w.data_ptr(), 4, None, y.data_ptr(), 4, 1) == 1
    assert lib.small_gemm_bf16(x.data_ptr(), 2, 8, 4, w.data_ptr(), 4, None, y.data_ptr(), 4, 1) == 1
    assert lib.pack_pairs_bf16(w.data_ptr(), 4, 8, 7, y.data_ptr()) == 1  # NOTE: stride < k
