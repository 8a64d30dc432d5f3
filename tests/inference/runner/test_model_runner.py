"""The model runner: persistent input buffers, one upload per step, padded batch buckets."""

from __future__ import annotations

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.runner.inputs import pick_bucket
from tests.inference.engine.conftest import random_prompts, tiny_llama
from tests.reference import float64_copy, max_logprob_error


def config(**overrides) -> InferenceConfig:
    fields = dict(block_size=4, num_blocks=128, max_requests=16, max_batch_tokens=64, chunked_prefill_size=16,
                  max_sequence_length=64)
    fields.update(overrides)
    return InferenceConfig(**fields)


@pytest.fixture(scope="module")
def hf():
    return tiny_llama(layers=2, hidden=64, seed=12)


def record_steps(engine):
    """Wrap the runner's forward to record each step's input tensors (and the padding)."""
    seen = []
    forward = engine.runner.forward

    def spy(inputs):
        seen.append(inputs)
        return forward(inputs)

    engine.core.runner.forward = spy
    return seen


def test_step_inputs_live_in_the_same_buffers_every_step(hf):
    engine = DynamicInferenceEngine.from_pretrained(hf, config())
    seen = record_steps(engine)
    engine.generate(random_prompts(10, 3, 30, seed=1), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(seen) > 10
    names = ("input_ids", "positions", "logits_indices")
    for name in names:
        assert len({getattr(s, name).data_ptr() for s in seen}) == 1, name
    for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
        assert len({getattr(s.meta, name).data_ptr() for s in seen}) == 1, name
    base = engine.runner.buffers.dev
    lo, hi = base.data_ptr(), base.data_ptr() + base.numel()
    assert all(lo <= getattr(seen[0], n).data_ptr() < hi for n in names)


def test_padded_bucketed_batches_give_the_same_tokens_and_logprobs(hf):
    prompts = random_prompts(12, 3, 30, seed=2)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=7, ignore_eos=True, logprobs=2)
    plain = DynamicInferenceEngine.from_pretrained(hf, config())
    padded = DynamicInferenceEngine.from_pretrained(hf, config(batch_buckets=(4, 8, 16, 32, 64)))
    seen = record_steps(padded)
    want = plain.generate(prompts, params)
    got = padded.generate(prompts, params)
    assert sum(s.num_padding for s in seen) > 0
    assert {s.input_ids.shape[0] for s in seen} <= {4, 8, 16, 32, 64}
    assert [o.generated_token_ids for o in got] == [o.generated_token_ids for o in want]
    # padding changes the matmuls' shapes, hence their rounding: each run against HF in float64.
    # NOTE: |log p| < 7 (tiny logits), half an fp32 ulp 2.4e-7 there; measured max 6.2e-7; 5e-6 is 8x
    reference = float64_copy(hf)
    for outputs in (want, got):
        assert max_logprob_error(reference, outputs) < 5e-6
    assert padded.allocator.active == 0


def test_bucket_choice():
    assert pick_bucket(5, (4, 8, 16)) == 8
    assert pick_bucket(8, (4, 8, 16)) == 8
    assert pick_bucket(17, (4, 8, 16)) == 17  # past the largest: eager, unpadded
    assert pick_bucket(5, None) == 5
    with pytest.raises(ValueError, match="batch_buckets"):
        config(batch_buckets=(8, 4))
