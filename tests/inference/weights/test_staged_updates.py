"""Staged weight updates: begin / load (buckets) / commit or abort, under both stagings."""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, EngineStateError, InferenceConfig, SamplingParams, Staging
from inference.errors import WeightNameError, WeightShapeError
from tests.inference.engine.conftest import random_prompts, tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = random_prompts(6, 4, 20, seed=51)


def config() -> InferenceConfig:
    return InferenceConfig(block_size=4, num_blocks=128, max_requests=8, max_batch_tokens=64, max_sequence_length=64)


def outputs(engine):
    return [o.generated_token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def old():
    return tiny_llama(seed=21)


@pytest.fixture(scope="module")
def new():
    return tiny_llama(seed=22)


@pytest.fixture(scope="module")
def fresh_new_outputs(new):
    return outputs(DynamicInferenceEngine.from_pretrained(new, config()))


def buckets(model, size=5):
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    return [dict(named[i : i + size]) for i in range(0, len(named), size)]


def count_prefix_resets(engine):
    calls = []
    real = engine.allocator.reset_prefix_cache
    engine.allocator.reset_prefix_cache = lambda: (calls.append(1), real())[1]
    return calls


def snapshot(engine):
    return {n: t.clone() for n, t in engine.model.named_tensors().items()}


@pytest.mark.parametrize("staging", list(Staging))
def test_a_committed_update_equals_a_fresh_engine_with_one_version_change(old, new, fresh_new_outputs, staging):
    engine = DynamicInferenceEngine.from_pretrained(old, config())
    before = outputs(engine)
    resets = count_prefix_resets(engine)
    engine.begin_update(version=5, staging=staging)
    for i, bucket in enumerate(buckets(new)):
        assert engine.load_weights(bucket) > 0
        assert engine.policy_version == 0 and not resets  # nothing changes before the commit
        if staging is Staging.DOUBLE and i == 0:
            assert outputs(engine) == before  # the old weights keep serving meanwhile
    assert engine.commit_update() == 5
    assert engine.policy_version == 5 and len(resets) == 1
    after = engine.generate(PROMPTS, GREEDY)
    assert [o.generated_token_ids for o in after] == fresh_new_outputs
    assert {v for o in after for v in o.token_versions} == {5}


def test_an_aborted_double_update_changes_nothing(old, new):
    engine = DynamicInferenceEngine.from_pretrained(old, config())
    before, weights = outputs(engine), snapshot(engine)
    resets = count_prefix_resets(engine)
    engine.begin_update(staging=Staging.DOUBLE)
    parts = buckets(new)
    with pytest.raises(RuntimeError, match="sender died"):
        engine.load_weights(parts[0])
        raise RuntimeError("sender died")  # between two loads
    engine.abort_update()
    assert engine.policy_version == 0 and not resets
    assert all(torch.equal(t, weights[n]) for n, t in engine.model.named_tensors().items())
    assert outputs(engine) == before


def test_an_aborted_in_place_update_refuses_until_a_complete_one(old, new, fresh_new_outputs):
    engine = DynamicInferenceEngine.from_pretrained(old, config())
    outputs(engine)
    waiting = engine.add_request(PROMPTS[0], GREEDY)
    engine.begin_update(staging=Staging.IN_PLACE)
    with pytest.raises(EngineStateError, match="in-place"):
        engine.generate(PROMPTS, GREEDY)  # refused from begin_update on
    parts = buckets(new)
    with pytest.raises(RuntimeError, match="sender died"):
        engine.load_weights(parts[0])
        raise RuntimeError("sender died")
    engine.abort_update()
    assert engine.policy_version == 0
    with pytest.raises(EngineStateError, match="mixed"):
        engine.add_request(PROMPTS[0], GREEDY)
    assert engine.step() == [] and engine.has_unfinished_requests()  # nothing runs on mixed weights
    engine.begin_update(staging=Staging.IN_PLACE)
    for bucket in parts:
        engine.load_weights(bucket)
    assert engine.commit_update() == 1
    assert outputs(engine) == fresh_new_outputs
    done = engine.step()  # it was stepped along by generate(); its output waits for step()
    while engine.has_unfinished_requests():
        done += engine.step()
    assert [o.request_id for o in done] == [waiting]  # recomputed under the new weights (policy RECOMPUTE)
    assert done[0].generated_token_ids == fresh_new_outputs[0]


def test_bad_buckets_and_incomplete_commits_are_refused(old, new):
    engine = DynamicInferenceEngine.from_pretrained(old, config())
    parts = buckets(new)
    engine.begin_update(staging=Staging.IN_PLACE)
    with pytest.raises(EngineStateError, match="already open"):
        engine.begin_update()
    bad = dict(parts[0])
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(WeightShapeError):
        engine.load_weights(bad)
    engine.load_weights(parts[0])
    with pytest.raises(WeightNameError, match="twice"):
        engine.load_weights(parts[0])
    with pytest.raises(WeightNameError, match="not loaded"):
        engine.commit_update()
    assert engine.policy_version == 0
    for bucket in parts[1:]:
        engine.load_weights(bucket)
    assert engine.commit_update() == 1


def test_a_one_call_update_heals_mixed_weights(old, new, fresh_new_outputs):
    engine = DynamicInferenceEngine.from_pretrained(old, config())
    engine.begin_update(staging=Staging.IN_PLACE)
    engine.load_weights(buckets(new)[0])
    engine.abort_update()
    assert engine.update_weights(new.named_parameters()) == 1
    assert outputs(engine) == fresh_new_outputs


def test_retained_staging_buffers_are_reused_and_freed_by_suspend(old, new, fresh_new_outputs):
    engine = DynamicInferenceEngine.from_pretrained(old, config())
    old_outputs = outputs(engine)
    first_ptrs = {n: t.data_ptr() for n, t in engine.model.named_tensors().items()}
    engine.begin_update(staging=Staging.DOUBLE, retain_staging=True)
    for bucket in buckets(new):
        engine.load_weights(bucket)
    engine.commit_update()
    assert engine.stats()["weights_spare_bytes"] == sum(t.numel() * t.element_size()
                                                        for t in engine.model.named_tensors().values())
    assert outputs(engine) == fresh_new_outputs
    # the next update copies into the weights the last commit replaced: no new allocation
    engine.begin_update(staging=Staging.DOUBLE, retain_staging=True)
    parts = buckets(old)
    engine.load_weights(parts[0])
    engine.abort_update()  # an abort hands its buffers back, whatever they hold
    assert outputs(engine) == fresh_new_outputs
    engine.begin_update(staging=Staging.DOUBLE, retain_staging=True)
    for bucket in parts:
        engine.load_weights(bucket)
    engine.commit_update()
    assert {n: t.data_ptr() for n, t in engine.model.named_tensors().items()} == first_ptrs
    assert outputs(engine) == old_outputs
    engine.suspend()
    assert engine.stats()["weights_spare_bytes"] == 0
    engine.resume()
    engine.begin_update(staging=Staging.DOUBLE)  # without it, a commit keeps no spare
    for bucket in buckets(new):
        engine.load_weights(bucket)
    engine.commit_update()
    assert engine.stats()["weights_spare_bytes"] == 0 and outputs(engine) == fresh_new_outputs


def test_staging_buffers_written_in_place_are_adopted_without_a_copy(old, new, fresh_new_outputs):
    """A transport writes a double update straight into the buffers the engine hands out; loading
    those very tensors adopts them (the live weights become them), other tensors are copied."""
    engine = DynamicInferenceEngine.from_pretrained(old, config())
    old_outputs = outputs(engine)
    named = dict((n, p.detach()) for n, p in new.named_parameters())
    engine.begin_update(staging=Staging.DOUBLE, retain_staging=True)
    handed = engine.staging_buffers(list(named)[:4])
    assert all(engine.staging_buffers([n])[n] is handed[n] for n in list(named)[:2])  # the same buffers again
    for name, buf in handed.items():
        buf.copy_(named[name])
    engine.load_weights(handed)
    engine.load_weights({n: t for n, t in named.items() if n not in handed})
    assert outputs(engine) == old_outputs  # double: nothing changed before the commit
    engine.commit_update()
    live = engine.model.named_tensors()
    assert all(live[n].data_ptr() == buf.data_ptr() for n, buf in handed.items())  # adopted, not copied
    assert outputs(engine) == fresh_new_outputs
    # the next update is handed the weights this commit replaced (warm spares), not new memory
    spare_ptrs = engine.core.weights._spare
    spare_ptrs = {n: t.data_ptr() for n, t in spare_ptrs.items()}
    engine.begin_update(staging=Staging.DOUBLE, retain_staging=True)
    again = engine.staging_buffers(list(named))
    assert {n: t.data_ptr() for n, t in again.items()} == spare_ptrs
    engine.abort_update()  # handed out, never loaded: back to the spares
    assert outputs(engine) == fresh_new_outputs and engine.policy_version == 1
    assert engine.stats()["weights_spare_bytes"] == sum(t.numel() * t.element_size() for t in live.values())


def test_staging_buffers_are_refused_where_a_transport_cannot_write_them(old):
    engine = DynamicInferenceEngine.from_pretrained(old, config())
    with pytest.raises(EngineStateError, match="double-staged"):
        engine.staging_buffers(["model.norm.weight"])  # no update open
    engine.begin_update(staging=Staging.IN_PLACE)
    with pytest.raises(EngineStateError, match="double-staged"):
        engine.staging_buffers(["model.norm.weight"])  # in place: load() writes the live weights
    engine.abort_update()
    engine.begin_update(staging=Staging.DOUBLE)
    with pytest.raises(WeightNameError, match="not tensors of this model"):
        engine.staging_buffers(["decoder.layers.0.self_attention.linear_qkv.weight"])  # another layout: load() converts
    engine.abort_update()


def test_the_open_update_is_the_engines_one_record_of_it(old, new):
    """What a weight receiver reads back across calls: which update (a new serial each time), its
    version, what feeds it and whether it is held until an explicit commit; what it still lacks."""
    engine = DynamicInferenceEngine.from_pretrained(old, config())
    assert engine.open_update() is None and engine.update_missing() == []
    engine.begin_update(version=3, origin="wsync", held=True)
    first = engine.open_update()
    assert (first.version, first.origin, first.held) == (3, "wsync", True)
    parts = buckets(new)
    engine.load_weights(parts[0])
    missing = engine.update_missing()
    assert missing and not set(missing) & set(parts[0])
    engine.abort_update()
    assert engine.open_update() is None
    engine.begin_update()
    second = engine.open_update()
    assert second.serial != first.serial and (second.version, second.origin, second.held) == (None, "", False)
    for part in parts:
        engine.load_weights(part)
    assert engine.update_missing() == []
    assert engine.commit_update() == 1 and engine.open_update() is None
