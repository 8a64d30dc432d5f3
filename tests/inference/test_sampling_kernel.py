"""The sampler's native path (csrc/sample_rows.c) against a float64 reference and the torch path."""

from __future__ import annotations

import pytest
import torch

from inference import native, sampling_kernel
from inference.sampling import SamplingBatch, sample
from inference.sampling_params import LogprobsMode, SamplingParams

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler on this machine")


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
    tokens, maxes, totals, raw_totals = sampling_kernel.sample_rows(logits, inv_t, u, raw=True)
    assert tokens.dtype == torch.int64 and ((tokens >= 0) & (tokens < vocab)).all()
    lo, hi = reference_interval(logits, inv_t, tokens)
    # NOTE: the kernel's exp is ~2e-7 relative; an interval may move by that much, never more
    assert ((u >= lo - 1e-5) & (u <= hi + 1e-5)).all(), (u, lo, hi)
    torch.testing.assert_close(maxes, logits.amax(-1))
    expected = ((logits.double() - maxes.double()[:, None]) * inv_t.double()[:, None]).exp().sum(-1)
    torch.testing.assert_close(totals, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(raw_totals, (logits.double() - maxes.double()[:, None]).exp().sum(-1), rtol=1e-6, atol=0)


def test_tokens_of_zero_weight_never_win():
    rows, vocab = 200, 3000
    logits = torch.full((rows, vocab), float("-inf"))
    allowed = torch.tensor([5, 1023, 1024, 2999])
    logits[:, allowed] = torch.tensor([0.0, 1.0, -200.0, 2.0])  # NOTE: -200 is below exp's range: weight 0
    u = torch.linspace(0, 1, rows + 1, dtype=torch.float64)[:-1]
    u[-1] = 1 - 2**-53  # the top of the mass
    tokens, _, totals, _ = sampling_kernel.sample_rows(logits, torch.ones(rows), u)
    assert set(tokens.tolist()) == {5, 1023, 2999}
    assert torch.isfinite(totals).all()


def test_a_cold_temperature_keeps_to_the_top_token():
    logits = torch.randn(32, 5000, generator=torch.Generator().manual_seed(1))
    tokens, _, totals, _ = sampling_kernel.sample_rows(logits, torch.full((32,), 1e4),
                                                       torch.rand(32, dtype=torch.float64))
    assert torch.equal(tokens, logits.argmax(-1)) and torch.isfinite(totals).all()


def test_strided_rows_are_read_in_place():
    full = torch.randn(16, 4000, generator=torch.Generator().manual_seed(2))
    view = full[:, :3000]
    u = torch.rand(16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(sampling_kernel.sample_rows(view, torch.ones(16), u)[0],
                       sampling_kernel.sample_rows(view.contiguous(), torch.ones(16), u)[0])


@pytest.mark.parametrize("mode", [LogprobsMode.RAW, LogprobsMode.PROCESSED])
def test_the_sampler_gives_the_same_log_probs_on_both_paths(monkeypatch, mode):
    logits = torch.randn(48, 8000, generator=torch.Generator().manual_seed(4)) * 3
    params = [SamplingParams(temperature=t, seed=100 + i, logprobs=3, logprobs_mode=mode)
              for i, t in enumerate([1.0, 0.7, 0.0, 1.3] * 12)]
    native_out = sample(logits, SamplingBatch.from_params(params))
    monkeypatch.setattr(sampling_kernel, "usable", lambda logits: False)
    torch_out = sample(logits, SamplingBatch.from_params(params))
    # NOTE: same seeds -> same uniforms; a token may differ only where u sits on an interval's edge
    same = native_out.token_ids == torch_out.token_ids
    assert same.float().mean() >= 0.95
    torch.testing.assert_close(native_out.logprobs[same], torch_out.logprobs[same], atol=1e-5, rtol=0)
    torch.testing.assert_close(native_out.top_logprobs, torch_out.top_logprobs, atol=1e-5, rtol=0)
    greedy = torch.tensor([p.temperature == 0 for p in params])
    assert torch.equal(native_out.token_ids[greedy], logits.argmax(-1)[greedy])
