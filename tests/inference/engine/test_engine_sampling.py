"""Truncated sampling (top-k, top-p, min-p) and top-n log-probs through the engine, against HF.

The sampler has its own tests; these check that a request's parameters reach it through the
engine (per slot, across steps and batches) and that what comes back is the model's. Each check
is run once more against a planted bug and must catch it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import inference.core.outputs as out_ops
from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from tests.inference.engine.conftest import random_prompts, tiny_llama
from tests.reference import float64_copy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = random_prompts(3, 4, 12, seed=61)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=6)


def samples(model, params):
    """(engine outputs, HF's float64 log-softmax at T=1 of the positions that sampled each generated token)."""
    engine = DynamicInferenceEngine.from_pretrained(model, InferenceConfig(
        block_size=4, num_blocks=256, max_requests=64, max_batch_tokens=128, max_sequence_length=64))
    outs = engine.generate(PROMPTS, params)
    reference = float64_copy(model)
    rows = []
    with torch.no_grad():
        for out in outs:
            ids = torch.tensor([out.prompt_token_ids + out.generated_token_ids])
            logits = reference(ids).logits[0, len(out.prompt_token_ids) - 1 : -1]
            rows.append(torch.log_softmax(logits, -1))
    return outs, rows


def kept_by(name: str, value: float, logp: torch.Tensor, temperature: float) -> torch.Tensor:
    """Bool [V]: tokens the truncation keeps, computed from the (float64) distribution at `temperature`.

    NOTE: the boundaries give way by the engine's fp32 rounding (~1e-7 relative, see LOGPROB_TOL), so
    a token the engine rightly keeps on a boundary counts as kept: 1e-6 of mass (top-p), 1e-6 of the
    bound (min-p)."""
    probs = torch.softmax(logp / temperature, -1)
    if name == "top_k":
        return probs >= probs.topk(int(value)).values[-1]
    if name == "top_p":
        ordered, index = probs.sort(descending=True)
        before = ordered.cumsum(0) - ordered  # mass of the strictly more likely tokens
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[index] = before < value + 1e-6
        return keep
    return probs >= value * probs.max() * (1 - 1e-6)  # min_p


KNOBS = [("top_k", 3), ("top_p", 0.3), ("min_p", 0.9)]
# NOTE: |log p| < 7 (384 tokens, tiny logits), where half an fp32 ulp is 2.4e-7: measured max
# |engine - float64 HF| 5e-7; 5e-6 is 10x. The top 6 of each row checked are > 1.7e-4 apart: a firm order.
LOGPROB_TOL = 5e-6


def check_truncation(model, name, value):
    params = SamplingParams(n=12, temperature=1.5, max_tokens=6, seed=5, ignore_eos=True, **{name: value})
    outs, rows = samples(model, params)
    kept_sizes = []
    for out, logp in zip(outs, rows):
        for tok, row in zip(out.generated_token_ids, logp):
            keep = kept_by(name, value, row, 1.5)
            kept_sizes.append(int(keep.sum()))
            assert keep[tok], f"{name}={value}: sampled token {tok} is outside the kept set"
    # the truncation keeps a small part of the vocabulary: an untruncated run would leave it
    assert max(kept_sizes) < 0.6 * rows[0].shape[-1]


@pytest.mark.parametrize("name, value", KNOBS)
def test_truncated_sampling_keeps_only_the_kept_tokens(model, name, value):
    check_truncation(model, name, value)


def check_top_logprobs(model):
    params = SamplingParams(n=4, temperature=0.8, max_tokens=6, seed=9, logprobs=5, ignore_eos=True)
    outs, rows = samples(model, params)
    for out, logp in zip(outs, rows):
        assert len(out.top_logprobs) == len(out.generated_token_ids)
        for tok, lp, top, row in zip(out.generated_token_ids, out.logprobs, out.top_logprobs, logp):
            assert abs(lp - row[tok].item()) < LOGPROB_TOL  # RAW: the model's log-softmax, not the sampled one
            want = torch.topk(row, 5)
            assert list(top) == want.indices.tolist()
            assert max(abs(a - b) for a, b in zip(top.values(), want.values.tolist())) < LOGPROB_TOL


def test_top_n_logprobs_are_the_models(model):
    check_top_logprobs(model)


@pytest.fixture
def planted_rows_lose_their_parameters(monkeypatch):
    """Planted bug: the per-slot truncations and log-prob mode do not reach the sampler."""
    original = out_ops.sampling_batch

    def dropped(ctx, slots):
        batch = original(ctx, slots)
        rows = batch.temperature.shape[0]
        return dataclasses.replace(batch, top_k=torch.zeros(rows, dtype=torch.int64), top_p=torch.ones(rows),
                                   min_p=torch.zeros(rows),
                                   logprobs_mode=torch.ones(rows, dtype=torch.bool))  # processed, not raw

    monkeypatch.setattr(out_ops, "sampling_batch", dropped)


@pytest.mark.parametrize("name, value", KNOBS)
def test_the_truncation_check_catches_dropped_parameters(model, name, value, planted_rows_lose_their_parameters):
    with pytest.raises(AssertionError, match="outside the kept set"):
        check_truncation(model, name, value)


def test_the_top_n_check_catches_processed_logprobs(model, planted_rows_lose_their_parameters):
    with pytest.raises(AssertionError):
        check_top_logprobs(model)
