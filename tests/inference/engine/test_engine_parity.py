"""End-to-end: greedy generation through a small, pausing, chunk-prefilling engine equals HF."""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from tests.inference.engine.conftest import hf_greedy, random_prompts, tiny_llama, tiny_qwen3
from tests.reference import float64_copy

MAX_NEW = 24
# NOTE: log-probs |log p| < 7 (384 tokens, tiny logits), where half an fp32 ulp is 2.4e-7: measured
# max |engine - float64 HF| 6e-7 (~3 ulps); 5e-6 is 8x
LOGPROB_TOL = 5e-6


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_greedy_matches_hf_with_pauses_and_chunked_prefill(build):
    hf = build()
    prompts = random_prompts(64, 2, 60, seed=1)
    config = InferenceConfig(
        block_size=4, num_blocks=96, max_requests=24, max_batch_tokens=64, chunked_prefill_size=16,
        max_sequence_length=128,
    )
    engine = DynamicInferenceEngine.from_pretrained(hf, config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    # the pool is small on purpose: requests must have been paused or evicted and recomputed
    assert sum(o.num_preemptions for o in outputs) > 0
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        assert out.generated_token_ids == hf_greedy(hf, prompt, MAX_NEW)
        assert out.finish_reason.value == "length"
    assert engine.allocator.active == 0


def test_logprobs_match_hf_log_softmax(llama):
    prompts = random_prompts(6, 3, 20, seed=2)
    engine = DynamicInferenceEngine.from_pretrained(llama, InferenceConfig(block_size=4, num_blocks=64, max_requests=8,
                                                                           max_batch_tokens=64, max_sequence_length=64))
    outputs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True))
    reference = float64_copy(llama)
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt + out.generated_token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(reference(ids).logits[0], -1)
        expected = logp[len(prompt) - 1 : -1].gather(1, torch.tensor(out.generated_token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(out.logprobs, dtype=torch.float64), expected, atol=LOGPROB_TOL, rtol=0)
        assert out.token_versions == [0] * len(out.generated_token_ids)


def test_prompt_logprobs_match_hf(llama):
    prompt = random_prompts(1, 30, 30, seed=4)[0]
    engine = DynamicInferenceEngine.from_pretrained(llama, InferenceConfig(block_size=4, num_blocks=64, max_requests=4,
                                                                           max_batch_tokens=64, chunked_prefill_size=7,
                                                                           max_sequence_length=64))
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    with torch.no_grad():
        logp = torch.log_softmax(float64_copy(llama)(torch.tensor([prompt])).logits[0], -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entry = out.prompt_logprobs[i]
        assert abs(entry[prompt[i]] - logp[i - 1, prompt[i]].item()) < LOGPROB_TOL
        top = torch.topk(logp[i - 1], 3)
        for tok, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[tok] - lp) < LOGPROB_TOL


def test_seeded_sampling_is_independent_of_batch(llama):
    config = InferenceConfig(block_size=4, num_blocks=128, max_requests=16, max_batch_tokens=64, max_sequence_length=64)
    prompt = random_prompts(1, 10, 10, seed=5)[0]
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    alone = DynamicInferenceEngine.from_pretrained(llama, config).generate([prompt], params)[0]
    others = random_prompts(7, 3, 30, seed=6)
    crowd = DynamicInferenceEngine.from_pretrained(llama, config).generate(
        others[:3] + [prompt] + others[3:], [SamplingParams(temperature=1.0, max_tokens=20)] * 3 + [params]
        + [SamplingParams(temperature=0.7, max_tokens=9)] * 4,
    )[3]
    assert crowd.generated_token_ids == alone.generated_token_ids


def test_prompt_logprobs_survive_finishing_in_the_prefill_step(llama):
    engine = DynamicInferenceEngine.from_pretrained(llama, InferenceConfig(block_size=4, num_blocks=64, max_requests=4,
                                                                           max_batch_tokens=64, max_sequence_length=64))
    prompt = random_prompts(1, 9, 9, seed=31)[0]
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
