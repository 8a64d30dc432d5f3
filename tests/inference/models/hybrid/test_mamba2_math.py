"""The Mamba2 pieces against their definitions: the chunked scan is the recurrence, the conv
window carries a chunk into the next, and the layer gives the same rows however a request's
tokens are cut into chunks and decode steps. Plus the gate / norm variants of the families."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.models.hybrid.mamba2 import (
    GateNorm,
    Mamba2Dims,
    Mamba2Weights,
    conv_decode,
    conv_prefill,
    mamba2_layer,
    ssd_scan,
    ssm_step,
)
from tests.inference.models.hybrid.tiny import tiny_hybrid
from tests.reference import float64_everywhere

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_ssm(t: int, h: int = 4, p: int = 3, g: int = 2, n: int = 5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, p, generator=gen, dtype=torch.float64)
    dt = torch.rand(t, h, generator=gen, dtype=torch.float64) * 0.5
    A = -torch.rand(h, generator=gen, dtype=torch.float64) * 4 - 0.1
    B = torch.randn(t, g, n, generator=gen, dtype=torch.float64)
    C = torch.randn(t, g, n, generator=gen, dtype=torch.float64)
    D = torch.randn(h, generator=gen, dtype=torch.float64)
    h0 = torch.randn(h, p, n, generator=gen, dtype=torch.float64)
    return x, dt, A, B, C, D, h0


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 40), chunk=st.integers(1, 16), with_h0=st.booleans(), seed=st.integers(0, 1000))
def test_chunked_scan_is_the_recurrence(t, chunk, with_h0, seed):
    x, dt, A, B, C, D, h0 = random_ssm(t, seed=seed)
    h0 = h0 if with_h0 else None
    y, final = ssd_scan(x, dt, A, B, C, D, h0, chunk)
    state = torch.zeros_like(random_ssm(1)[-1]) if h0 is None else h0.clone()
    for i in range(t):
        y_i, state = ssm_step(x[i : i + 1], dt[i : i + 1], A, B[i : i + 1], C[i : i + 1], D, state[None])
        state = state[0]
        # NOTE: float64 on both sides: ~40 steps of float64 rounding (1e-16 each) are far below 1e-9
        torch.testing.assert_close(y[i], y_i[0], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(final, state, rtol=1e-9, atol=1e-9)


def test_conv_window_carries_a_chunk_into_the_next():
    gen = torch.Generator().manual_seed(1)
    # NOTE: float64, so a whole-prompt and a chunked conv agree to float64 rounding (default tolerance
    # 1e-7), not to fp32 kernels whose rounding depends on the shape and the CPU
    x = torch.randn(11, 6, generator=gen, dtype=torch.float64)
    w, b = torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randn(6, generator=gen, dtype=torch.float64)
    whole, window = conv_prefill(x, None, w, b)
    first, mid = conv_prefill(x[:5], None, w, b)
    second, end = conv_prefill(x[5:9], mid, w, b)
    steps, win = [], end
    for i in range(9, 11):
        y, win = conv_decode(x[i : i + 1], win[None], w, b)
        steps.append(y)
        win = win[0]
    torch.testing.assert_close(torch.cat([first, second, *steps]), whole)
    torch.testing.assert_close(win, window)


@pytest.mark.parametrize("family", ["bamba", "falcon_h1"])
def test_a_layer_gives_the_same_rows_however_the_tokens_are_cut(family):
    from inference import DynamicInferenceEngine, InferenceConfig

    model = DynamicInferenceEngine.from_pretrained(tiny_hybrid(family), InferenceConfig(num_blocks=8)).model
    mixer = next(m for _, ms in model._blocks for m in ms if m.spec.kind.value == "mamba")
    dims: Mamba2Dims = model.spec.mamba
    w: Mamba2Weights = mixer.w
    h = torch.randn(13, dims.hidden_size, generator=torch.Generator().manual_seed(2))

    def pools(dtype=torch.float32):
        return torch.zeros(3, *dims.conv_state_shape, dtype=dtype), torch.zeros(3, *dims.ssm_state_shape, dtype=dtype)

    # the reference: the whole prompt at once, in float64 (the layer's fp32 upcasts mapped to float64 too)
    w64 = Mamba2Weights(*(None if getattr(w, n) is None else getattr(w, n).double() for n in Mamba2Weights.__slots__))
    scale64 = None if model._proj_scale is None else model._proj_scale.double()
    conv64, ssm64 = pools(torch.float64)
    with float64_everywhere():
        want = mamba2_layer(h.double(), w64, dims, conv64, ssm64, torch.tensor([0]), torch.tensor([True]), [0, 13],
                            0, scale64)
    conv, ssm = pools()
    whole = mamba2_layer(h, w, dims, conv, ssm, torch.tensor([0]), torch.tensor([True]), [0, 13], 0,
                         model._proj_scale)
    conv2, ssm2 = pools()
    parts = [mamba2_layer(h[:6], w, dims, conv2, ssm2, torch.tensor([1]), torch.tensor([True]), [0, 6], 0,
                          model._proj_scale),
             mamba2_layer(h[6:11], w, dims, conv2, ssm2, torch.tensor([1]), torch.tensor([False]), [0, 5], 0,
                          model._proj_scale)]
    for i in (11, 12):  # decode steps, batched with nothing else
        parts.append(mamba2_layer(h[i : i + 1], w, dims, conv2, ssm2, torch.tensor([1]), torch.tensor([False]),
                                  [0, 1], 1, model._proj_scale))
    # NOTE: the fp32 rows, SSM states and conv windows, each way, against float64, to 40 fp32 eps
    # (5e-6) of each one's largest value: measured max 4.0e-7, 2.9e-7 and 2.2e-7 of it
    def check(got, ref):
        torch.testing.assert_close(got.double(), ref, rtol=0, atol=5e-6 * ref.abs().max().item())

    for rows, states, window in ((whole, ssm[0], conv[0]), (torch.cat(parts), ssm2[1], conv2[1])):
        check(rows, want)
        check(states, ssm64[0])
        check(window, conv64[0])


@pytest.mark.parametrize("overrides, gate", [(dict(mamba_rms_norm=False), GateNorm.GATE_ONLY),
                                             (dict(mamba_norm_before_gate=False), GateNorm.GATE_THEN_NORM)])
def test_falcon_h1_gate_variants_match_hf(overrides, gate):
    from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
    from tests.inference.engine.conftest import hf_greedy

    hf = tiny_hybrid("falcon_h1", seed=4, **overrides)
    engine = DynamicInferenceEngine.from_pretrained(hf, InferenceConfig(block_size=4, num_blocks=64))
    assert engine.model.spec.mamba.gate_norm is gate
    prompts = [[5, 17, 33, 9, 120, 7], [44, 3, 3, 250, 61, 90, 11, 8, 200]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.generated_token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
