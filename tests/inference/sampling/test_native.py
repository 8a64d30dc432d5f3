"""The sampler's native path (csrc/sample_rows.c) and its torch path, each against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from inference.sampling import native
from inference.sampling.batch import SamplingBatch
from inference.sampling.params import LogprobsMode, SamplingParams
from inference.sampling.sampler import sample
from inference.sampling.seeds import make_generator
from tests.inference.native_util import needs_compiler

# NOTE: the kernel is tested wherever a C compiler is, whatever ROLLOUT_ENGINE_NO_KERNELS says
pytestmark = [needs_compiler, pytest.mark.usefixtures("native_kernels")]


# NOTE: the kernel sums 128-token blocks in fp32 (128 / L terms per vector lane: L = 4 at x86-64-v2,
# 8 at v3, 16 at v4), blocks in float64. Summing whole 1024-token chunks in fp32 measured 1.7e-6 at
# v2 (a numpy replica of 4 fp32 lanes: 1.6e-6); 128-token blocks measure 2.1e-7 at v2, 1.4e-7 native
# (256 x 49,152 rows). 1e-6 is 5x the worst build.
TOTALS_RTOL = 1e-6


def reference_interval(logits: torch.Tensor, inv_t: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float64 cumulative probability just before and at each row's token."""
    z = logits.double() * inv_t.double()[:, None]
    p = torch.softmax(z, -1)
    cdf = p.cumsum(-1)
    at = cdf.gather(1, tokens[:, None])[:, 0]
    return at - p.gather(1, tokens[:, None])[:, 0], at


@pytest.mark.parametrize("vocab", [1, 7, 1024, 1500, 49152])
@pytest.mark.parametrize("temperature", [1.0, 0.3, 2.5])
def test_tokens_are_the_inverse_cdf_of_the_uniforms(vocab, temperature):
    gen = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=gen) * 4
    inv_t = torch.full((rows,), 1 / temperature)
    u = torch.rand(rows, dtype=torch.float64, generator=gen)
    tokens, maxes, totals, raw_totals = native.sample_rows(logits, inv_t, u, raw=True)
    assert tokens.dtype == torch.int64 and ((tokens >= 0) & (tokens < vocab)).all()
    lo, hi = reference_interval(logits, inv_t, tokens)
    # NOTE: the cumulative mass the kernel searches is off by its chunk sums' relative error (< 1e-6,
    # TOTALS_RTOL) and its exp's (2e-7), so an interval's edge moves by < 1.2e-6: 1e-5 leaves 8x
    assert ((u >= lo - 1e-5) & (u <= hi + 1e-5)).all(), (u, lo, hi)
    assert torch.equal(maxes, logits.amax(-1))  # a max is exact in any order
    expected = ((logits.double() - maxes.double()[:, None]) * inv_t.double()[:, None]).exp().sum(-1)
    torch.testing.assert_close(totals, expected, rtol=TOTALS_RTOL, atol=0)
    raw_expected = (logits.double() - maxes.double()[:, None]).exp().sum(-1)
    torch.testing.assert_close(raw_totals, raw_expected, rtol=TOTALS_RTOL, atol=0)


def test_tokens_of_zero_weight_never_win():
    rows, vocab = 200, 3000
    logits = torch.full((rows, vocab), float("-inf"))
    allowed = torch.tensor([5, 1023, 1024, 2999])
    logits[:, allowed] = torch.tensor([0.0, 1.0, -200.0, 2.0])  # NOTE: -200 is below exp's range: weight 0
    u = torch.linspace(0, 1, rows + 1, dtype=torch.float64)[:-1]
    u[-1] = 1 - 2**-53  # the top of the mass
    tokens, _, totals, _ = native.sample_rows(logits, torch.ones(rows), u)
    assert set(tokens.tolist()) == {5, 1023, 2999}
    assert torch.isfinite(totals).all()


def test_a_cold_temperature_keeps_to_the_top_token():
    logits = torch.randn(32, 5000, generator=torch.Generator().manual_seed(1))
    tokens, _, totals, _ = native.sample_rows(logits, torch.full((32,), 1e4),
                                                       torch.rand(32, dtype=torch.float64))
    assert torch.equal(tokens, logits.argmax(-1)) and torch.isfinite(totals).all()


def test_strided_rows_are_read_in_place():
    full = torch.randn(16, 4000, generator=torch.Generator().manual_seed(2))
    view = full[:, :3000]
    u = torch.rand(16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(native.sample_rows(view, torch.ones(16), u)[0],
                       native.sample_rows(view.contiguous(), torch.ones(16), u)[0])


@pytest.mark.parametrize("mode", [LogprobsMode.RAW, LogprobsMode.PROCESSED])
def test_both_sampler_paths_give_the_float64_tokens_and_log_probs(monkeypatch, mode):
    logits = torch.randn(48, 8000, generator=torch.Generator().manual_seed(4)) * 3
    temperatures = [1.0, 0.7, 0.0, 1.3] * 12
    params = [SamplingParams(temperature=t, seed=100 + i, logprobs=3, logprobs_mode=mode)
              for i, t in enumerate(temperatures)]
    native_out = sample(logits, SamplingBatch.from_params(params))
    monkeypatch.setattr(native, "usable", lambda logits: False)
    torch_out = sample(logits, SamplingBatch.from_params(params))
    greedy = torch.tensor([t == 0 for t in temperatures])
    inv_t = torch.tensor([t or 1.0 for t in temperatures]).reciprocal()  # float32, as the sampler's
    u = torch.stack([torch.rand((), dtype=torch.float64, generator=make_generator(100 + i)) for i in range(48)])
    scale = inv_t.double()[:, None] if mode is LogprobsMode.PROCESSED else 1.0
    ref = torch.log_softmax(logits.double() * scale, -1)
    for out in (native_out, torch_out):
        assert torch.equal(out.token_ids[greedy], logits.argmax(-1)[greedy])
        lo, hi = reference_interval(logits[~greedy], inv_t[~greedy], out.token_ids[~greedy])
        assert ((u[~greedy] >= lo - 1e-5) & (u[~greedy] <= hi + 1e-5)).all()  # NOTE: as in the test above
        assert torch.equal(out.top_token_ids, logits.topk(3, -1).indices)
        # NOTE: |log p| < 16 here: three fp32 roundings of half an ulp (4.8e-7) each, plus the
        # normaliser's relative error (< 2e-6, TOTALS_RTOL): 5e-6. Measured max 6.9e-7 (v2 build).
        torch.testing.assert_close(out.logprobs.double(), ref.gather(1, out.token_ids[:, None])[:, 0],
                                   atol=5e-6, rtol=0)
        torch.testing.assert_close(out.top_logprobs.double(), ref.gather(1, out.top_token_ids), atol=5e-6, rtol=0)
