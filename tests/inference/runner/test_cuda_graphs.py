"""CUDA-graph replay. On CPU: the piece sequence the graphs are captured from (`eager_piecewise`)
computes what the model's forward does, for a dense and an MoE decoder, at every bucket. On GPU
(`gpu` marker): replay equals eager, graphs are freed on suspend and captured again on resume without
growing memory, in-place weight updates keep them, a rebind re-captures them."""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.runner.cuda_graphs import eager_piecewise, supports_pieces
from tests.inference.engine.conftest import random_prompts, tiny_llama
from tests.inference.models.moe.tiny import tiny_moe
from tests.reference import float64_copy, max_logprob_error

BUCKETS = dict(batch_buckets=(8, 16, 32), decode_buckets=(1, 2, 4, 8))
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def config(**overrides) -> InferenceConfig:
    fields = dict(block_size=4, num_blocks=128, max_requests=8, max_batch_tokens=32, chunked_prefill_size=16,
                  max_sequence_length=64, **BUCKETS)
    fields.update(overrides)
    return InferenceConfig(**fields)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("serve", ["forward", "pieces"])
def test_the_captured_pieces_compute_the_forward(family, serve):
    """Each step runs both; the tokens come from `serve`'s logits, its log-probs checked against float64."""
    hf = tiny_llama(seed=5) if family == "llama" else tiny_moe(family, seed=5)
    engine = DynamicInferenceEngine.from_pretrained(hf, config())
    model = engine.model
    assert supports_pieces(model)
    checked = []
    forward = engine.runner.forward

    def both(inputs):
        logits = forward(inputs)
        static = getattr(model, "static_shapes", None)
        if static is not None:
            model.static_shapes = True  # what capture uses: fixed-shape expert exchange
        try:
            pieces = eager_piecewise(model, inputs, engine.kv_cache)  # rewrites the same K/V
        finally:
            if static is not None:
                model.static_shapes = static
        # NOTE: two fp32 roundings of the same logits (|x| < 1, ulp <= 1.2e-7; the MoE pieces take
        # the static expert exchange, whose matmul shapes differ): measured max 1.6e-7 apart; 1e-5 is 60x
        assert torch.allclose(pieces, logits, atol=1e-5, rtol=0)
        checked.append(inputs.padded_tokens)
        return pieces if serve == "pieces" else logits

    engine.core.runner.forward = both
    outputs = engine.generate(random_prompts(6, 3, 30, seed=2), GREEDY)
    assert {1, 2, 4, 8} & set(checked) and {16, 32} & set(checked)
    # NOTE: |log p| < 7 (384 tokens, tiny logits), half an fp32 ulp 2.4e-7 there; measured max 6.2e-7; 5e-6 is 8x
    assert max_logprob_error(float64_copy(hf), outputs) < 5e-6


# ---- on the device ------------------------------------------------------------------------------

def gpu_config(**overrides) -> InferenceConfig:
    return config(device="cuda", dtype=torch.float32, **overrides)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def gpu_model(request):
    hf = tiny_llama(seed=6) if request.param == "llama" else tiny_moe(request.param, seed=6)
    return hf.cuda()


@pytest.mark.gpu
def test_replay_equals_eager(gpu_model):
    prompts = random_prompts(8, 3, 30, seed=3)
    eager = DynamicInferenceEngine.from_pretrained(gpu_model, gpu_config()).generate(prompts, GREEDY)
    engine = DynamicInferenceEngine.from_pretrained(gpu_model, gpu_config(cuda_graphs=True))
    got = engine.generate(prompts, GREEDY)
    assert [o.generated_token_ids for o in got] == [o.generated_token_ids for o in eager]
    for g, e in zip(got, eager):
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0)
    stats = engine.stats()
    assert stats["graph_replays"] > 0 and stats["graph_buckets"] == [1, 2, 4, 8, 16, 32]


@pytest.mark.gpu
def test_suspend_frees_the_graphs_and_resume_captures_them_without_growing(gpu_model):
    engine = DynamicInferenceEngine.from_pretrained(gpu_model, gpu_config(cuda_graphs=True))
    prompts = random_prompts(4, 3, 20, seed=4)
    want = engine.generate(prompts, GREEDY)
    after_resume = []
    for _ in range(3):
        engine.suspend()
        assert engine.stats()["graph_buckets"] == []
        engine.resume()
        torch.cuda.synchronize()
        after_resume.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
        got = engine.generate(prompts, GREEDY)
        assert [o.generated_token_ids for o in got] == [o.generated_token_ids for o in want]
    assert engine.stats()["graph_captures"] == 4
    assert after_resume[-1][0] <= after_resume[0][0]  # nothing leaks across suspends
    assert after_resume[-1][1] <= after_resume[0][1]


@pytest.mark.gpu
def test_in_place_updates_keep_the_graphs_and_a_rebind_recaptures(gpu_model):
    engine = DynamicInferenceEngine.from_pretrained(gpu_model, gpu_config(cuda_graphs=True))
    prompts = random_prompts(4, 3, 20, seed=5)
    engine.generate(prompts, GREEDY)
    other = (tiny_llama(seed=7) if not hasattr(gpu_model.config, "num_experts") else tiny_moe("qwen3_moe", seed=7))
    other = other.cuda()
    engine.update_weights(dict(other.named_parameters()))  # copied in place: same addresses
    assert engine.stats()["graph_captures"] == 1
    fresh = DynamicInferenceEngine.from_pretrained(other, gpu_config()).generate(prompts, GREEDY)
    got = engine.generate(prompts, GREEDY)
    assert [o.generated_token_ids for o in got] == [o.generated_token_ids for o in fresh]
    engine.bind_trainer_model(other)  # aliased: new addresses
    assert engine.stats()["graph_captures"] == 2
    got = engine.generate(prompts, GREEDY)
    assert [o.generated_token_ids for o in got] == [o.generated_token_ids for o in fresh]
