"""Suspend / resume, weight updates and policy versions (the colocated RL contract)."""

from __future__ import annotations

import copy

import pytest
import torch

from inference import (
    DynamicInferenceEngine,
    EngineState,
    InferenceConfig,
    SamplingParams,
    SuspendedAddPolicy,
    SuspendPolicy,
    TensorStateDeallocatedError,
    UpdatePolicy,
)
from inference.core.memory import process_rss_bytes
from inference.errors import EngineStateError, ResumeMemoryError, WeightNameError, WeightShapeError
from tests.inference.engine.conftest import random_prompts, tiny_llama

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def config(**overrides) -> InferenceConfig:
    fields = dict(block_size=4, num_blocks=96, max_requests=8, max_batch_tokens=64, chunked_prefill_size=16,
                  max_sequence_length=96)
    fields.update(overrides)
    return InferenceConfig(**fields)


def perturb_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def run_all(engine, prompts, params=GREEDY):
    return [o.generated_token_ids for o in engine.generate(prompts, params)]


# ---- state machine ------------------------------------------------------------------------


def test_state_machine_transitions(llama):
    engine = DynamicInferenceEngine.from_pretrained(llama, config())
    with pytest.raises(EngineStateError, match="without suspend"):
        engine.resume()
    engine.suspend()
    assert engine.state is EngineState.SUSPENDED and not engine.kv_cache.is_allocated
    assert engine.suspend().buffer_bytes == 0  # a second suspend is a no-op
    with pytest.raises(TensorStateDeallocatedError) as exc:
        engine.add_request([3, 4, 5], GREEDY)
    assert exc.value.is_transient
    with pytest.raises(TensorStateDeallocatedError):
        engine.generate([[3, 4, 5]], GREEDY)
    engine.resume()
    assert engine.state is EngineState.RUNNING and engine.kv_cache.is_allocated
    assert run_all(engine, [[3, 4, 5]]) == run_all(DynamicInferenceEngine.from_pretrained(llama, config()), [[3, 4, 5]])


def test_add_while_suspended_queues_when_configured(llama):
    engine = DynamicInferenceEngine.from_pretrained(llama, config(suspended_add_policy=SuspendedAddPolicy.QUEUE))
    engine.suspend()
    rid = engine.add_request([3, 4, 5, 6], GREEDY)
    assert engine.step() == []  # nothing runs while suspended
    engine.resume()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == [rid] and len(outputs[0].generated_token_ids) == 16


def test_resume_without_memory_fails_cleanly_and_stays_suspended(llama, monkeypatch):
    engine = DynamicInferenceEngine.from_pretrained(llama, config(suspend_policy=SuspendPolicy.RECOMPUTE))
    rid = engine.add_request([3, 4, 5, 6, 7], GREEDY)
    engine.step()
    engine.suspend()
    monkeypatch.setattr("inference.core.sleep.available_device_memory", lambda device: 1024)
    with pytest.raises(ResumeMemoryError):
        engine.resume()
    assert engine.state is EngineState.SUSPENDED and not engine.kv_cache.is_allocated
    monkeypatch.undo()
    engine.resume()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[0].request_id == rid and len(outputs[0].generated_token_ids) == 16


# ---- suspend / resume under each in-flight policy -----------------------------------------


def cycle_run(engine, prompts, cycles, policy):
    """Keep requests in flight and suspend/resume after every step, `cycles` times."""
    pending = list(prompts)
    outputs, rss = [], []
    for _ in range(cycles):
        while pending and len(engine.scheduler.live) < 6:
            engine.add_request(pending.pop(0), GREEDY)
        outputs += engine.step()
        engine.suspend(policy)
        engine.resume()
        rss.append(process_rss_bytes())
    for prompt in pending:
        engine.add_request(prompt, GREEDY)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return sorted(outputs, key=lambda o: o.request_id), rss


@pytest.mark.parametrize("policy", [SuspendPolicy.RECOMPUTE, SuspendPolicy.OFFLOAD, SuspendPolicy.ABORT])
def test_hundred_suspend_resume_cycles(llama, policy):
    prompts = random_prompts(40, 3, 30, seed=21)
    expected = run_all(DynamicInferenceEngine.from_pretrained(llama, config()), prompts)
    engine = DynamicInferenceEngine.from_pretrained(llama, config(num_blocks=4096))
    outputs, rss = cycle_run(engine, prompts, 100, policy)
    assert [o.prompt_token_ids for o in outputs] == prompts  # no request lost, none twice
    if policy is SuspendPolicy.ABORT:
        assert any(o.finish_reason.value == "abort" for o in outputs)
        for out, full in zip(outputs, expected):
            assert full[: len(out.generated_token_ids)] == out.generated_token_ids  # partial prefixes
    else:
        assert [o.generated_token_ids for o in outputs] == expected
    assert engine.allocator.active == 0 and engine.kv_cache.is_allocated
    assert abs(rss[-1] - rss[0]) <= 0.02 * rss[0]


def test_suspend_releases_the_kv_buffer_measured_by_rss(llama):
    # 2 layers x K,V x 4 tokens x 2 heads x 16 dims x 4 bytes = 2 KiB per block: 64 MiB of KV
    engine = DynamicInferenceEngine.from_pretrained(llama, config(num_blocks=32768))
    engine.kv_cache.data.fill_(1.0)  # make every page resident, as a long run would
    report = engine.suspend()
    assert report.buffer_bytes == 64 * 2**20
    assert report.measured_freed_bytes >= 0.95 * report.buffer_bytes
    before = process_rss_bytes()
    engine.resume()
    engine.kv_cache.data.fill_(1.0)
    assert process_rss_bytes() - before >= 0.95 * report.buffer_bytes


def test_offload_weights_round_trip(llama):
    engine = DynamicInferenceEngine.from_pretrained(llama, config())  # owns copies of the weights
    expected = run_all(engine, [[5, 6, 7, 8]])
    report = engine.suspend(offload_weights=True)
    assert report.offloaded_weight_bytes == sum(p.numel() * 4 for p in llama.parameters())
    assert all(t.untyped_storage().nbytes() == 0 for t in engine.model.named_tensors().values())
    engine.resume()
    assert run_all(engine, [[5, 6, 7, 8]]) == expected


def test_offload_weights_leaves_aliased_trainer_weights_alone(llama):
    engine = DynamicInferenceEngine.from_pretrained(llama, config(), share_weights=True)
    assert engine.suspend(offload_weights=True).offloaded_weight_bytes == 0
    assert all(p.untyped_storage().nbytes() > 0 for p in llama.parameters())
    engine.resume()


# ---- weight updates and versions ----------------------------------------------------------


def test_aliased_update_matches_a_fresh_engine_and_never_hits_across_versions():
    trainer = tiny_llama(seed=3)
    engine = DynamicInferenceEngine.from_pretrained(trainer, config(), share_weights=True)
    prompts = random_prompts(6, 8, 20, seed=22) * 2
    # NOTE: the repeats come in a second call (the prefix cache gets hits); in one call they would
    # join the first ones' groups and fork from their prefills
    generate = lambda: engine.generate(prompts[:6], GREEDY) + engine.generate(prompts[6:], GREEDY)  # noqa: E731
    before = generate()
    hits_v0 = engine.allocator.hit_blocks
    assert hits_v0 > 0 and {v for o in before for v in o.token_versions} == {0}
    perturb_(trainer, seed=1)  # the trainer's optimizer step, in place
    assert engine.on_weights_updated() == 1
    after = generate()
    fresh = DynamicInferenceEngine.from_pretrained(copy.deepcopy(trainer), config())
    assert [o.generated_token_ids for o in after] == run_all(fresh, prompts)
    assert [o.generated_token_ids for o in after] != [o.generated_token_ids for o in before]
    assert {v for o in after for v in o.token_versions} == {1}
    assert engine.stats()["cross_version_prefix_hits"] == 0
    assert engine.allocator.hit_blocks > hits_v0  # version 1 hit its own blocks


def test_copy_update_matches_a_fresh_engine():
    engine = DynamicInferenceEngine.from_pretrained(tiny_llama(seed=4), config())
    prompts = random_prompts(5, 6, 20, seed=23)
    run_all(engine, prompts)
    target = tiny_llama(seed=5)
    version = engine.update_weights(target.named_parameters(), version=7)
    assert version == engine.policy_version == 7
    outputs = engine.generate(prompts, GREEDY)
    assert [o.generated_token_ids for o in outputs] == run_all(
        DynamicInferenceEngine.from_pretrained(target, config()), prompts)
    assert {v for o in outputs for v in o.token_versions} == {7}
    assert engine.stats()["cross_version_prefix_hits"] == 0


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda d: d.update({"model.layers.0.mlp.bogus.weight": torch.zeros(2)}), WeightNameError),
        (lambda d: d.pop("model.norm.weight"), WeightNameError),
        (lambda d: d.update({"model.norm.weight": torch.zeros(3)}), WeightShapeError),
        (lambda d: d.update({"model.norm.weight": torch.zeros(64, dtype=torch.int64)}), WeightShapeError),
    ],
)
def test_bad_update_is_refused_and_old_weights_stay(mutate, error):
    engine = DynamicInferenceEngine.from_pretrained(tiny_llama(seed=4), config())
    prompts = random_prompts(3, 6, 12, seed=24)
    before = run_all(engine, prompts)
    update = {n: p.detach() + 1.0 for n, p in tiny_llama(seed=6).named_parameters()}
    mutate(update)
    with pytest.raises(error):
        engine.update_weights(update)
    assert engine.policy_version == 0
    assert run_all(engine, prompts) == before


def test_update_refuses_to_write_into_aliased_trainer_weights(llama):
    engine = DynamicInferenceEngine.from_pretrained(llama, config(), share_weights=True)
    with pytest.raises(EngineStateError, match="on_weights_updated"):
        engine.update_weights(tiny_llama(seed=9).named_parameters())


@pytest.mark.parametrize("policy", [UpdatePolicy.KEEP, UpdatePolicy.RECOMPUTE, UpdatePolicy.ABORT])
def test_in_flight_requests_at_an_update(policy):
    trainer = tiny_llama(seed=7)
    engine = DynamicInferenceEngine.from_pretrained(trainer, config(), share_weights=True)
    prompt = random_prompts(1, 10, 10, seed=25)[0]
    rid = engine.add_request(prompt, GREEDY)
    for _ in range(6):
        engine.step()
    perturb_(trainer, seed=2)
    engine.on_weights_updated(policy)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    outputs += engine.step()
    (out,) = [o for o in outputs if o.request_id == rid]
    versions = out.token_versions
    if policy is UpdatePolicy.ABORT:
        assert out.finish_reason.value == "abort" and set(versions) == {0}
        return
    assert len(versions) == 16 and versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    if policy is UpdatePolicy.RECOMPUTE:
        # the tokens after the update are what the new weights say, given everything before
        old = out.generated_token_ids[: versions.count(0)]
        fresh = DynamicInferenceEngine.from_pretrained(copy.deepcopy(trainer), config())
        (cont,) = fresh.generate([prompt + old], SamplingParams(temperature=0, max_tokens=16 - len(old),
                                                                ignore_eos=True))
        assert out.generated_token_ids[len(old):] == cont.generated_token_ids
