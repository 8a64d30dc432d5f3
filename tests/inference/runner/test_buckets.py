"""Batch buckets, padding and dummy steps on CPU: what CUDA-graph replay and expert-parallel lockstep
rely on, run eagerly (the graphs themselves: test_cuda_graphs.py, gpu; engines in lockstep:
core/test_ep_step.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.runner.buckets import IDLE, BatchDims, BucketPolicy
from tests.inference.engine.conftest import random_prompts, tiny_llama

BUCKETS = dict(batch_buckets=(8, 16, 32), decode_buckets=(2, 4, 8))


def config(**overrides) -> InferenceConfig:
    fields = dict(block_size=4, num_blocks=96, max_requests=8, max_batch_tokens=32, chunked_prefill_size=16,
                  max_sequence_length=64)
    fields.update(overrides)
    return InferenceConfig(**fields)


@pytest.fixture(scope="module")
def hf():
    return tiny_llama(layers=2, hidden=64, seed=3)


def test_bucket_policy_pads_decodes_by_requests_and_mixed_steps_by_tokens():
    policy = BucketPolicy((8, 16, 32), (2, 4, 8))
    assert policy.sizes == (32, 16, 8, 4, 2)
    assert policy.match(BatchDims(3, 3, False)) == 4  # decode-only: 3 requests -> decode bucket 4
    assert policy.match(BatchDims(3, 2, True)) == 8  # a prefill among them: token bucket
    assert policy.match(BatchDims(9, 9, False)) is None  # past the largest decode bucket: eager
    assert policy.match(BatchDims(33, 4, True)) is None
    assert policy.match(IDLE) is None
    assert BucketPolicy(None).match(BatchDims(3, 3, False)) is None
    assert BucketPolicy((8, 16)).match(BatchDims(3, 3, False)) == 8  # decodes default to the token buckets


def test_agreed_dims_are_the_elementwise_max_and_cover_every_rank():
    ranks = [BatchDims.of_plan(np.array([1, 1, 1]), 3), BatchDims.of_plan(np.array([5, 1]), 1), IDLE]
    agreed = BatchDims.from_list(np.max([d.to_list() for d in ranks], axis=0).tolist())
    assert agreed == BatchDims(6, 3, True)
    size = BucketPolicy((8, 16, 32), (2, 4, 8)).match(agreed)
    assert all(size >= d.tokens and size >= d.requests for d in ranks)


def test_config_checks_the_buckets():
    with pytest.raises(ValueError, match="decode_buckets needs batch_buckets"):
        config(decode_buckets=(2, 4))
    with pytest.raises(ValueError, match="decode_buckets must be increasing"):
        config(batch_buckets=(8,), decode_buckets=(4, 2))
    with pytest.raises(ValueError, match="cuda_graphs needs batch_buckets and a CUDA device"):
        config(batch_buckets=(8,), cuda_graphs=True)
    assert config(**BUCKETS).largest_bucket == 32


def test_decode_buckets_give_the_same_tokens_and_pad_decodes_to_them(hf):
    prompts = random_prompts(5, 3, 20, seed=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = DynamicInferenceEngine.from_pretrained(hf, config()).generate(prompts, params)
    engine = DynamicInferenceEngine.from_pretrained(hf, config(**BUCKETS))
    shapes = []
    forward = engine.runner.forward
    engine.core.runner.forward = lambda inputs: (shapes.append((inputs.num_decode, inputs.padded_tokens)),
                                                 forward(inputs))[1]
    got = engine.generate(prompts, params)
    assert [o.generated_token_ids for o in got] == [o.generated_token_ids for o in want]
    assert {t for _, t in shapes} <= {2, 4, 8, 16, 32}
    assert any(t in (2, 4) for _, t in shapes)  # decode-only steps padded by requests
    assert engine.allocator.active == 0


def test_a_dummy_step_writes_only_the_scratch_block(hf):
    engine = DynamicInferenceEngine.from_pretrained(hf, config(**BUCKETS))
    engine.generate(random_prompts(3, 9, 20, seed=6), SamplingParams(temperature=0, max_tokens=3))
    data = engine.kv_cache.data  # [layers, 2, blocks, block_size, heads, head_dim]
    before = data.clone()
    pool = engine.allocator.stats()
    runner = engine.runner
    inputs = runner.prepare_dummy(BatchDims(5, 2, True))
    scratch = engine.caches.scratch_block
    assert inputs.padded_tokens == 8 and inputs.num_tokens == 0 and inputs.logits_indices.numel() == 0
    assert (inputs.meta.slot_mapping // 4 == scratch).all()
    assert runner.forward(inputs).shape[0] == 0
    others = [b for b in range(data.shape[2]) if b != scratch]
    assert torch.equal(before[:, :, others], data[:, :, others])
    assert engine.allocator.stats() == pool
