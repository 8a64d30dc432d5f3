"""Hybrid attention + Mamba2 models through the engine against HF transformers (fp32, torch path).

For each family (Bamba, Nemotron-H, Falcon-H1), 32 prompts sharing prefixes: greedy tokens equal
HF `generate`'s and log-probs are within 5e-6 of an HF forward of the same tokens in float64, with chunked
prefill and prefix-cache hits that restore Mamba state mid-prompt (counted), and again through a
pool so small that requests pause and are evicted.
"""

from __future__ import annotations

import random

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.models.hybrid.decoder import HybridDecoder
from tests.inference.engine.conftest import hf_greedy
from tests.inference.models.hybrid.tiny import FAMILIES, VOCAB, tiny_hybrid
from tests.reference import float64_copy, max_logprob_error

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
# NOTE: |log p| < 8 (384 tokens, logits < 1): a few fp32 roundings of half an ulp (4.8e-7) there.
# Measured max |engine - float64 HF| 5.7e-7 over the families and the CPU settings CI simulates: 9x.
TOLERANCE = 5e-6
MAX_DIFF: dict[str, float] = {}  # family -> max |dlogprob| seen (printed by the last test)


def prompts_with_shared_prefixes(count: int, seed: int) -> list[list[int]]:
    """Prompts of 3-30 tokens, most starting with one of three shared prefixes cut at random lengths."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, VOCAB) for _ in range(22)] for _ in range(3)]
    out = []
    for _ in range(count):
        head = rng.choice(heads)[: rng.randrange(0, 23)] if rng.random() < 0.8 else []
        out.append(head + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 9))])
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def case(request):
    """(family, HF model, prompts, HF greedy continuations)."""
    hf = tiny_hybrid(request.param, seed=3)
    prompts = prompts_with_shared_prefixes(32, seed=5)
    return request.param, hf, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def max_logprob_diff(hf, outputs) -> float:
    """Largest |engine - HF| log-prob over every generated token (HF in float64: one forward per sequence)."""
    return max_logprob_error(float64_copy(hf), outputs)


def config(**overrides) -> InferenceConfig:
    fields = dict(block_size=4, num_blocks=512, max_requests=16, max_batch_tokens=64, chunked_prefill_size=12,
                  max_sequence_length=64)
    fields.update(overrides)
    return InferenceConfig(**fields)


def test_chunked_prefill_and_mamba_prefix_hits_match_hf(case):
    family, hf, prompts, expected = case
    engine = DynamicInferenceEngine.from_pretrained(hf, config())
    assert isinstance(engine.model, HybridDecoder) and engine.model.spec.num_mamba_layers == 2
    # two waves: the second finds the first's blocks and state snapshots (the first finds its own)
    outputs = engine.generate(prompts[:16], GREEDY) + engine.generate(prompts[16:], GREEDY)
    assert [o.generated_token_ids for o in outputs] == expected
    MAX_DIFF[family] = max(MAX_DIFF.get(family, 0.0), max_logprob_diff(hf, outputs))
    assert MAX_DIFF[family] < TOLERANCE
    stats = engine.stats()
    assert stats["state_prefix_hits"] > 0 and stats["prefix_cached_tokens"] > 0
    # every prompt token was either computed once or served by the cache, never both
    assert stats["prefill_tokens"] + stats["prefix_cached_tokens"] == sum(len(p) for p in prompts)
    assert stats["state_slots_held"] == 0


def test_pauses_and_evictions_match_hf(case):
    family, hf, prompts, expected = case
    engine = DynamicInferenceEngine.from_pretrained(hf, config(num_blocks=36, paused_block_budget=2))
    outputs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert [o.generated_token_ids for o in outputs] == expected
    MAX_DIFF[family] = max(MAX_DIFF.get(family, 0.0), max_logprob_diff(hf, outputs))
    assert MAX_DIFF[family] < TOLERANCE
    assert engine.caches.states.held == 0 and engine.allocator.active == 0


def test_a_directory_loads_like_the_module(case, tmp_path):
    family, hf, prompts, expected = case
    hf.save_pretrained(tmp_path)
    engine = DynamicInferenceEngine.from_pretrained(tmp_path, config())
    assert engine.model.spec.family.value == family
    assert [o.generated_token_ids for o in engine.generate(prompts[:4], GREEDY)] == expected[:4]


def test_report_max_logprob_differences():
    print("max |dlogprob| vs HF:", {k: f"{v:.1e}" for k, v in sorted(MAX_DIFF.items())})
