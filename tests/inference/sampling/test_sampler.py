"""The sampler against direct (slow, per-row) computations, chi-square fits and seeded replays."""

import math
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference.sampling import sampler as sampler_module
from inference.sampling import truncation
from inference.sampling.batch import SamplingBatch
from inference.sampling.params import LogprobsMode, SamplingParams
from inference.sampling.sampler import Sampler, compute_prompt_logprobs, sample
from inference.sampling.seeds import make_generator

PROCESSED = LogprobsMode.PROCESSED


def batch_of(params, **kw) -> SamplingBatch:
    return SamplingBatch.from_params(params, **kw)


def reference(x: torch.Tensor, p: SamplingParams, tol: float = 1e-5):
    """Direct float64 computation for one row: (kept mask, log-probs over the kept set, ambiguous).

    top-k keeps x_i >= the k-th largest x; top-p keeps i when the renormalised mass of tokens with
    strictly larger x is < top_p; min-p keeps q_i >= min_p * max q. `ambiguous` is True when a token
    sits within `tol` of a top-p / min-p boundary, where float32 rounding may rightly go either way.
    """
    x = x.double()
    vocab = x.numel()
    t = p.temperature if p.temperature > 0 else 1.0
    z = x / t
    keep = torch.ones(vocab, dtype=torch.bool)
    if p.top_k > 0:
        kth = sorted(x.tolist(), reverse=True)[min(p.top_k, vocab) - 1]
        keep = x >= kth
    q = torch.where(keep, z, -math.inf).softmax(-1)
    ambiguous = False
    if p.top_p < 1:
        mass_above = torch.stack([q[keep & (x > x[i])].sum() for i in range(vocab)])
        ambiguous |= bool(((mass_above - p.top_p).abs() < tol)[keep].any())
        keep = keep & (mass_above < p.top_p)
    q = torch.where(keep, z, -math.inf).softmax(-1)
    if p.min_p > 0:
        bound = p.min_p * q.max()
        ambiguous |= bool(((q - bound).abs() < tol * q.max())[keep].any())
        keep = keep & (q >= bound)
    logq = torch.where(keep, z, -math.inf).log_softmax(-1)
    return keep, logq, ambiguous


row_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.7]),
    top_k=st.sampled_from([0, 0, 1, 2, 5, 40, 1000]),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.6)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=st.lists(row_params, min_size=1, max_size=5), vocab=st.integers(1, 300),
       scale=st.sampled_from([0.5, 2.0, 6.0]), ties=st.booleans(),
       histogram=st.sampled_from([(1024, 32.0, 16), (4, 1.0, 1), (2, 0.25, 2)]), seed=st.integers(0, 2**31))
def test_truncation_and_processed_logprobs_match_direct_computation(params, vocab, scale, ties, histogram, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), vocab, generator=g) * scale
    if ties:  # a coarse grid puts many tokens on the top-k / top-p boundaries
        logits = (logits * 2).round() / 2
    batch = batch_of([SamplingParams(**{**_fields(p), "logprobs_mode": PROCESSED}) for p in params])
    batch.num_top_logprobs = vocab  # every token, so the kept set is the finite entries
    # coarse top-p histograms put many tokens in the crossing bin, a short span most of the row in
    # the overflow bin, one or two rows per pass exercise the chunking
    bins, span, rows = histogram
    with mock.patch.multiple(truncation, _HIST_BINS=bins, _HIST_SPAN=span, _HIST_ROWS=rows):
        out = sample(logits, batch)
    for r, p in enumerate(params):
        keep, logq, ambiguous = reference(logits[r], p)
        got = torch.full((vocab,), -math.inf, dtype=torch.float64)
        got[out.top_token_ids[r]] = out.top_logprobs[r].double()
        if p.temperature == 0:
            assert out.token_ids[r] == logits[r].argmax()
        else:
            assert keep[out.token_ids[r]] or ambiguous
        if ambiguous:
            continue
        assert torch.equal(got.isfinite(), keep)
        # NOTE: |log q| reaches ~140 (logits x 6 at T = 0.3), where half an fp32 ulp is 7.6e-6; ~4
        # roundings (subtract, times the rounded 1/T, the normaliser): 3e-5. Measured max 6.5e-6.
        assert torch.allclose(got[keep], logq[keep], atol=1e-4, rtol=0)
        assert out.logprobs[r].item() == pytest.approx(logq[out.token_ids[r]].item(), abs=1e-4)


def _fields(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in SamplingParams.__dataclass_fields__}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_raw_logprobs_and_top_n_equal_log_softmax(dtype):
    torch.manual_seed(0)
    params = [SamplingParams(), SamplingParams(temperature=0.5, top_p=0.8), SamplingParams(top_k=3),
              SamplingParams(temperature=0), SamplingParams(temperature=1.3, min_p=0.2, seed=7)] * 4
    logits = (torch.randn(len(params), 1000) * 4).to(dtype)
    batch = batch_of(params)
    batch.num_top_logprobs = 20
    out = sample(logits, batch)
    ref = torch.log_softmax(logits.double(), -1)  # of the same (rounded) logits: exact
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    # NOTE: |log p| < 32 (logits x 4 over 1000 tokens): half an fp32 ulp <= 9.5e-7, three roundings
    # (x - max, minus log of the sum) plus the sum's own error: < 4e-6. Measured max 6.9e-7.
    assert torch.allclose(out.logprobs.double(), ref.gather(1, out.token_ids[:, None])[:, 0], atol=1e-5, rtol=0)
    top_ref = ref.topk(20, -1).values
    assert torch.allclose(out.top_logprobs.double(), top_ref, atol=1e-5, rtol=0)
    assert torch.allclose(ref.gather(1, out.top_token_ids), top_ref, atol=1e-5, rtol=0)


def test_greedy_is_argmax_and_mixed_modes_pick_per_row():
    torch.manual_seed(1)
    logits = torch.randn(6, 500) * 3
    params = [SamplingParams(temperature=0, top_k=2, logprobs_mode=PROCESSED), SamplingParams(temperature=0)] * 3
    out = sample(logits, batch_of(params))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    x = logits.double()
    raw = torch.log_softmax(x, -1).gather(1, out.token_ids[:, None])[:, 0]
    top2 = torch.log_softmax(x.topk(2, -1).values, -1)[:, 0]  # processed: renormalised top-2, T = 1
    # NOTE: |log p| < 4 here: three fp32 roundings of <= 2.4e-7 and the normaliser's, ~1e-6; measured 7e-8
    assert torch.allclose(out.logprobs[1::2].double(), raw[1::2], atol=1e-5, rtol=0)
    assert torch.allclose(out.logprobs[0::2].double(), top2[0::2], atol=1e-5, rtol=0)


def test_masked_vocabulary_is_never_sampled():
    logits = torch.randn(64, 300)
    logits[:, 150:] = -math.inf
    out = sample(logits, batch_of([SamplingParams(temperature=0.01)] * 32 + [SamplingParams(top_p=0.99)] * 32))
    assert bool((out.token_ids < 150).all()) and bool(out.logprobs.isfinite().all())


# ---- seeded determinism -------------------------------------------------------------------------

def _replay(logits_steps, params, position, others, other_logits):
    """Tokens a seeded row samples over several steps when batched with `others` at `position`."""
    gen = make_generator(params.seed)
    tokens, lps = [], []
    for step, row in enumerate(logits_steps):
        rows = list(others)
        rows.insert(position, params)
        gens = [None] * len(others)
        gens.insert(position, gen)
        batch_logits = torch.cat([other_logits[step][:position], row[None], other_logits[step][position:]])
        out = sample(batch_logits, batch_of(rows, generators=gens))
        tokens.append(int(out.token_ids[position]))
        lps.append(float(out.logprobs[position]))
    return tokens, lps


@settings(max_examples=25, deadline=None)
@given(target=row_params, seed=st.integers(0, 2**64 - 1), others=st.lists(row_params, max_size=6),
       position=st.integers(0, 6), vocab=st.sampled_from([7, 256, 700]))
def test_seeded_row_is_independent_of_the_rest_of_the_batch(target, seed, others, position, vocab):
    target = SamplingParams(**{**_fields(target), "seed": seed})
    position = min(position, len(others))
    g = torch.Generator().manual_seed(seed % 1000)
    steps = [torch.randn(vocab, generator=g) * 2 for _ in range(4)]
    alone = _replay(steps, target, 0, [], [torch.empty(0, vocab)] * 4)
    other_logits = [torch.randn(len(others), vocab) * 5 for _ in range(4)]
    crowded = _replay(steps, target, position, others, other_logits)
    assert alone[0] == crowded[0]
    # NOTE: not compared with each other: the batch decides between the native and the torch path
    # (truncation anywhere in it takes the torch path), whose roundings differ. Each is the float64
    # RAW log-prob: |log p| < 16, three half-ulps (4.8e-7) and the normaliser's < 2e-6: 4e-6; measured 3e-7.
    for tokens, logprobs in (alone, crowded):
        want = [float(torch.log_softmax(row.double(), -1)[t]) for row, t in zip(steps, tokens)]
        assert logprobs == pytest.approx(want, abs=1e-5)


def test_seeded_generator_advances_once_per_sampled_token():
    gen, ref = make_generator(123), make_generator(123)
    logits = torch.randn(3, 50)
    for _ in range(5):
        sample(logits, batch_of([SamplingParams()] * 3, generators=[None, gen, None]))
        torch.rand((), dtype=torch.float64, generator=ref)
    assert torch.equal(gen.get_state(), ref.get_state())


def test_sampler_workspace_matches_one_shot_sample():
    sampler = Sampler()
    for rows, vocab in [(4, 300), (2, 1000), (4, 300)]:  # grows, then reuses a larger buffer
        logits = torch.randn(rows, vocab)
        params = [SamplingParams(seed=i, top_p=0.9, temperature=0.8, logprobs=3) for i in range(rows)]
        a, b = sampler(logits, batch_of(params)), sample(logits, batch_of(params))
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.top_token_ids, b.top_token_ids)
    sampler.release()


# ---- empirical frequencies ----------------------------------------------------------------------

Z_1E6 = 4.753  # one-sided normal quantile for alpha = 1e-6: a correct sampler fails ~never


def chi2_critical(df: int, z: float = Z_1E6) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (no scipy here)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    return float(((counts - expected) ** 2 / expected).sum())


def draw(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    out = sample(logits.expand(n, -1), batch_of([params] * n))
    return torch.bincount(out.token_ids, minlength=logits.numel()).double()


LOGITS = torch.tensor([2.0, 1.6, 1.1, 0.9, 0.4, 0.0, -0.5, -1.0, -2.0, -3.0])


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.6), SamplingParams(temperature=1.0), SamplingParams(temperature=1.8),
     SamplingParams(top_k=4), SamplingParams(top_p=0.7, temperature=1.3),
     SamplingParams(min_p=0.2, temperature=0.8), SamplingParams(top_k=6, top_p=0.9, min_p=0.1)],
)
def test_frequencies_fit_the_target_distribution(params):
    torch.manual_seed(2024)
    counts = draw(LOGITS, params, 40_000)
    keep, logq, ambiguous = reference(LOGITS, params)
    assert not ambiguous
    assert counts[~keep].sum() == 0  # truncated tokens are never drawn
    target = logq[keep].exp()
    assert chi2(counts[keep], target) < chi2_critical(int(keep.sum()) - 1)
    # Power: samplers that got the temperature 15% wrong, or skipped truncation, fail this test.
    for wrong_t in (params.temperature * 1.15, params.temperature / 1.15):
        wrong = torch.where(keep, LOGITS.double() / wrong_t, -math.inf).softmax(-1)[keep]
        assert chi2(counts[keep], wrong) > chi2_critical(int(keep.sum()) - 1)
    if not bool(keep.all()):
        untruncated = (LOGITS.double() / params.temperature).softmax(-1)
        assert chi2(counts, untruncated) > chi2_critical(LOGITS.numel() - 1)


def test_frequencies_fit_across_chunks_of_a_large_vocabulary():
    vocab = 700  # three first-level chunks, the last one padded
    logits = torch.full((vocab,), -4.0)
    heavy = torch.tensor([0, 1, 255, 256, 257, 511, 512, 600, 698, 699])
    logits[heavy] = torch.linspace(2.5, 0.0, len(heavy))
    torch.manual_seed(7)
    counts = draw(logits, SamplingParams(temperature=0.9), 40_000)
    probs = (logits.double() / 0.9).softmax(-1)
    light = torch.ones(vocab, dtype=torch.bool)
    light[heavy] = False  # pooled into one bin so every expected count is large
    binned_c = torch.cat([counts[heavy], counts[light].sum()[None]])
    binned_p = torch.cat([probs[heavy], probs[light].sum()[None]])
    assert chi2(binned_c, binned_p) < chi2_critical(len(heavy))


def test_seeded_stream_frequencies_fit():
    gen = make_generator(99)
    params = SamplingParams(temperature=0.7, seed=99)
    batch = batch_of([params], generators=[gen])
    counts = torch.zeros(LOGITS.numel(), dtype=torch.float64)
    for _ in range(2500):
        counts[sample(LOGITS[None], batch).token_ids[0]] += 1
    assert chi2(counts, (LOGITS.double() / 0.7).softmax(-1)) < chi2_critical(LOGITS.numel() - 1)


# ---- prompt log-probs and batch plumbing --------------------------------------------------------

def test_prompt_logprobs_equal_log_softmax_in_row_chunks():
    torch.manual_seed(3)
    logits = (torch.randn(37, 400) * 3).bfloat16()
    targets = torch.randint(0, 400, (37,))
    with mock.patch.object(sampler_module, "_PROMPT_ROWS", 8):
        out = compute_prompt_logprobs(logits, targets, num_top=5)
    ref = torch.log_softmax(logits.double(), -1)  # of the same bf16 logits: exact
    # NOTE: |log p| < 16 (bf16 logits x 3 over 400 tokens): three fp32 half-ulps (4.8e-7) and the sum's
    # error: < 2e-6; measured max 6.2e-7
    assert torch.allclose(out.logprobs.double(), ref.gather(1, targets[:, None])[:, 0], atol=1e-5, rtol=0)
    assert torch.allclose(out.top_logprobs.double(), ref.topk(5, -1).values, atol=1e-5, rtol=0)
    assert compute_prompt_logprobs(logits, targets).top_logprobs is None
    # vLLM's rank, brute force over the vocabulary: the entries whose log-prob is >= the token's.
    # bf16 logits tie often (8 bits of mantissa over 400 tokens), and a tie counts ahead
    brute = (ref >= ref.gather(1, targets[:, None])).sum(-1)
    assert torch.equal(out.ranks, brute) and bool((out.ranks >= 1).all())
    ties = (ref == ref.gather(1, targets[:, None])).sum(-1)
    assert int((ties > 1).sum()) > 0  # the data has ties, or this could not tell ahead from behind


def test_empty_batch_and_batch_validation():
    out = sample(torch.empty(0, 10), batch_of([]))
    assert out.token_ids.shape == (0,) and out.top_logprobs is None
    ok = batch_of([SamplingParams()] * 2)
    with pytest.raises(ValueError, match="^top_p "):
        SamplingBatch(ok.temperature, ok.top_k, ok.top_p[:1], ok.min_p, [None, None])
    with pytest.raises(ValueError, match="^generators "):
        SamplingBatch(ok.temperature, ok.top_k, ok.top_p, ok.min_p, [None])
    with pytest.raises(ValueError, match="^logprobs_mode "):
        SamplingBatch(ok.temperature, ok.top_k, ok.top_p, ok.min_p, [None, None], logprobs_mode=torch.ones(3))


def test_from_params_flags_and_top_n():
    b = batch_of([SamplingParams(logprobs=4), SamplingParams(temperature=0, logprobs_mode=PROCESSED)])
    assert (b.use_top_k, b.use_top_p, b.use_min_p) == (False, False, False)
    assert b.unit_temperature and b.any_greedy and not b.all_greedy
    assert b.need_raw and b.need_processed and b.num_top_logprobs == 4
    assert b.logprobs_mode.tolist() == [False, True]


@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0])  # nuclei of ~7,000, ~thousands and a few tokens
def test_top_p_is_exact_on_wide_nuclei(scale):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 8_000, generator=g) * scale
    params = [SamplingParams(top_p=p, logprobs_mode=PROCESSED) for p in (0.5, 0.9, 0.95, 0.99)]
    batch = batch_of(params)
    batch.num_top_logprobs = 8_000
    out = sample(logits, batch)
    for r, p in enumerate(params):
        keep, _, ambiguous = reference(logits[r], p)
        got = torch.zeros(8_000, dtype=torch.bool)
        got[out.top_token_ids[r][out.top_logprobs[r].isfinite()]] = True
        assert torch.equal(got, keep) or ambiguous
        assert keep.sum() > (500 if scale < 4 else 0)
