"""One test per defect found in the engine core before it was reshaped (each failed on fef436a)."""

from __future__ import annotations

import dataclasses

import pytest

from inference import (
    DynamicInferenceEngine,
    InferenceConfig,
    ResumeMemoryError,
    SamplingParams,
    SuspendPolicy,
    UpdatePolicy,
)
from inference.sampling.seeds import sample_seed
from rollout import RolloutEngine
from tests.inference.engine.conftest import random_prompts, tiny_llama


def config(**overrides) -> InferenceConfig:
    fields = dict(block_size=4, num_blocks=64, max_requests=8, max_batch_tokens=64, chunked_prefill_size=16,
                  max_sequence_length=64)
    fields.update(overrides)
    return InferenceConfig(**fields)


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def test_failed_resume_does_not_offload_weights_that_suspend_kept(llama, monkeypatch):
    engine = DynamicInferenceEngine.from_pretrained(llama, config())
    expected = engine.generate([[5, 6, 7]], GREEDY)[0].generated_token_ids
    engine.suspend()  # weights stay resident
    monkeypatch.setattr(engine.kv_cache, "allocate", lambda: (_ for _ in ()).throw(RuntimeError("no memory")))
    with pytest.raises(ResumeMemoryError):
        engine.resume()
    assert all(t.untyped_storage().nbytes() > 0 for t in engine.model.named_tensors().values())
    monkeypatch.undo()
    engine.resume()
    assert engine.generate([[5, 6, 7]], GREEDY)[0].generated_token_ids == expected


def test_suspend_releases_and_counts_the_sampler_workspace(llama):
    engine = DynamicInferenceEngine.from_pretrained(llama, config())
    engine.generate(random_prompts(4, 3, 9), GREEDY)
    workspace = engine.sampler._workspace
    assert workspace is not None
    report = engine.suspend()
    assert engine.sampler._workspace is None
    assert report.workspace_bytes >= workspace.numel() * workspace.element_size()


def test_peak_kv_utilization_counts_the_step_in_which_requests_finish():
    # four distinct 8-token prompts (2 blocks each) that finish in their first step: the blocks
    # are in use during that step and released right after it
    engine = RolloutEngine(tiny_llama(seed=1), config())
    prompts = random_prompts(4, 8, 8, seed=3)
    batch = engine.generate(prompts, n=1, sampling=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    assert batch.stats.peak_kv_utilization == pytest.approx(8 / 64)


def test_prompt_tokens_count_each_prompt_once_per_group():
    engine = RolloutEngine(tiny_llama(seed=1), config())
    prompts = random_prompts(3, 5, 9, seed=4)
    batch = engine.generate(prompts, n=4, sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    assert batch.stats.prompt_tokens == sum(len(p) for p in prompts)


def test_nearby_seeds_give_unrelated_samples(llama):
    engine = DynamicInferenceEngine.from_pretrained(llama, config())
    prompt = [5, 6, 7, 8]
    base = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = engine.generate([prompt], dataclasses.replace(base, n=2, seed=5))
    b = engine.generate([prompt], dataclasses.replace(base, n=1, seed=6))
    assert a[1].generated_token_ids != b[0].generated_token_ids  # seed 5's sample 1 != seed 6's sample 0
    again = engine.generate([prompt], dataclasses.replace(base, n=2, seed=5))
    assert [o.generated_token_ids for o in again] == [o.generated_token_ids for o in a]  # still reproducible
    assert len({sample_seed(s, j) for s in range(100) for j in range(64)}) == 6400


def test_suspend_and_update_policies_are_separate_types(llama):
    assert {p.value for p in SuspendPolicy} == {"abort", "recompute", "offload"}
    assert {p.value for p in UpdatePolicy} == {"abort", "recompute", "keep"}
    engine = DynamicInferenceEngine.from_pretrained(llama, config())
    with pytest.raises(ValueError):
        engine.suspend("keep")
    with pytest.raises(ValueError):
        engine.on_weights_updated("offload")
    assert engine.policy_version == 0


def test_the_per_step_token_budget_is_named_max_batch_tokens():
    names = {f.name for f in dataclasses.fields(InferenceConfig)}
    assert "max_batch_tokens" in names and "max_tokens" not in names
    with pytest.raises(ValueError, match="max_batch_tokens"):
        InferenceConfig(max_requests=16, max_batch_tokens=8)


def test_abort_while_suspended_with_offloaded_kv_leaks_nothing(llama):
    engine = DynamicInferenceEngine.from_pretrained(llama, config())
    keep = engine.add_request([5, 6, 7, 8, 9], GREEDY)
    drop = engine.add_request([9, 8, 7, 6, 5, 4, 3], GREEDY)
    for _ in range(3):
        engine.step()
    engine.suspend(SuspendPolicy.OFFLOAD)
    assert engine.abort(drop)
    engine.resume()
    outputs = engine.step()
    while engine.has_unfinished_requests():
        outputs += engine.step()
    by_id = {o.request_id: o for o in outputs}
    assert by_id[drop].finish_reason.value == "abort"
    assert by_id[keep].generated_token_ids == engine.generate([[5, 6, 7, 8, 9]], GREEDY)[0].generated_token_ids
    assert engine.allocator.active == 0

