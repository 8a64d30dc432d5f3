"""For fixed logits, the exact output distribution of a verify step equals the target's (float64).

The sampler draws by inverse CDF, so its token is a non-decreasing function of the row's uniform:
bisecting on the uniform finds each token's interval, whose length is the token's exact
probability under the sampler. A verify step of two positions (the request's last token and one
proposed token `d`) keeps the sample at position 0 and, where it equals `d`, the sample at position
1: enumerating the product of both positions' intervals gives the exact distribution of what it
keeps, which must be the target's own: P0(t) for t != d, P0(d) * P1(t) for (d, t).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from inference.sampling.batch import SamplingBatch
from inference.sampling.params import SamplingParams
from inference.sampling.sampler import sample
from inference.speculation.verify import accepted_counts
from tests.inference.sampling.test_sampler import reference

VOCAB = 12
TOL = 2e-6  # float32 weights: ~1e-7 relative per token, summed


def _sample(rows: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> torch.Tensor:
    batch = SamplingBatch.from_params([params] * rows.shape[0], generators=[None] * rows.shape[0])
    batch.uniforms = uniforms
    return sample(rows, batch).token_ids


def token_intervals(x: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """`edges [V + 1]`: the sampler gives token t exactly for uniforms in [edges[t], edges[t + 1])."""
    lo = torch.zeros(VOCAB - 1, dtype=torch.float64)
    hi = torch.ones(VOCAB - 1, dtype=torch.float64)
    boundary = torch.arange(1, VOCAB)
    rows = x.expand(VOCAB - 1, VOCAB)
    for _ in range(64):  # NOTE: past 2**-53 the midpoint stops moving: the float64 interval is exact
        mid = (lo + hi) / 2
        above = _sample(rows, params, mid) >= boundary
        hi = torch.where(above, mid, hi)
        lo = torch.where(above, lo, mid)
    return np.concatenate(([0.0], hi.numpy(), [1.0]))


def exact_distribution(x: torch.Tensor, params: SamplingParams) -> np.ndarray:
    return np.diff(token_intervals(x, params))


def target_probs(x: torch.Tensor, params: SamplingParams) -> np.ndarray:
    if params.temperature == 0:
        probs = np.zeros(VOCAB)
        probs[int(x.argmax())] = 1.0
        return probs
    keep, logq, ambiguous = reference(x, params)
    assert not ambiguous  # NOTE: the fixed logits below sit far from every top-p boundary
    return logq.exp().numpy()


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.6),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_k=6, top_p=0.9),
]


def fixed_logits(seed: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_the_sampler_distribution_is_the_float64_target(params):
    for seed in range(3):
        x = fixed_logits(seed)
        np.testing.assert_allclose(exact_distribution(x, params), target_probs(x, params), atol=TOL, rtol=0)


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("draft_rank", [0, 2], ids=["likely-draft", "unlikely-draft"])
def test_a_verify_step_keeps_exactly_the_target_distribution(params, draft_rank):
    x0, x1 = fixed_logits(10), fixed_logits(11)
    draft = int(x0.argsort(descending=True)[draft_rank])
    edges0, edges1 = token_intervals(x0, params), token_intervals(x1, params)
    kept: dict[tuple[int, ...], float] = {}
    live0 = [t for t in range(VOCAB) if edges0[t + 1] > edges0[t]]
    live1 = [t for t in range(VOCAB) if edges1[t + 1] > edges1[t]]
    for t0, t1 in itertools.product(live0, live1):  # one representative uniform per product interval
        u = torch.tensor([(edges0[t0] + edges0[t0 + 1]) / 2, (edges1[t1] + edges1[t1 + 1]) / 2], dtype=torch.float64)
        sampled = _sample(torch.stack([x0, x1]), params, u).numpy()
        n = int(accepted_counts(sampled, [np.array([draft])], np.array([0]))[0])
        seq = tuple(sampled[: n + 1].tolist())
        mass = (edges0[t0 + 1] - edges0[t0]) * (edges1[t1 + 1] - edges1[t1])
        kept[seq] = kept.get(seq, 0.0) + mass
    p0, p1 = target_probs(x0, params), target_probs(x1, params)
    want = {(t,): p0[t] for t in range(VOCAB) if t != draft and p0[t] > 0}
    want.update({(draft, t): p0[draft] * p1[t] for t in range(VOCAB) if p0[draft] * p1[t] > 0})
    assert set(kept) <= set(want) | {s for s in kept if kept[s] < 1e-15}
    for seq in set(want) | set(kept):
        assert abs(kept.get(seq, 0.0) - want.get(seq, 0.0)) < TOL, seq
