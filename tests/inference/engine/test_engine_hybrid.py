"""A hybrid Mamba model through the engine: GRPO groups, suspend / resume (RSS), weight updates,
and the Mamba side of the prefix cache (backoff, budget, eviction cascading from KV)."""

from __future__ import annotations

import pytest
import torch

from inference import DynamicInferenceEngine, EvictionPolicy, InferenceConfig, SamplingParams, SuspendPolicy
from inference.core.memory import process_rss_bytes
from tests.inference.engine.conftest import hf_greedy, random_prompts
from tests.inference.models.hybrid.tiny import tiny_hybrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def config(**overrides) -> InferenceConfig:
    fields = dict(block_size=4, num_blocks=256, max_requests=16, max_batch_tokens=64, chunked_prefill_size=8,
                  max_sequence_length=64)
    fields.update(overrides)
    return InferenceConfig(**fields)


@pytest.fixture(scope="module")
def hf():
    return tiny_hybrid("bamba", seed=7)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(12, 3, 26, seed=17)


@pytest.fixture(scope="module")
def uninterrupted(hf, prompts):
    return [o.generated_token_ids for o in DynamicInferenceEngine.from_pretrained(hf, config()).generate(prompts,
                                                                                                         GREEDY)]


def snapshots_match_registry(engine) -> None:
    """Every held snapshot is a live Mamba entry of a live KV hash, and every Mamba entry has one."""
    snaps, registry = engine.caches.snapshots, engine.allocator.registry
    entries = {slot: entry for slot, entry in snaps._lru.items()}
    assert {h: b for b, h in entries.values()} == registry.mamba_hash_to_block_id
    for block, h in entries.values():
        assert registry.kv_hash_to_block_id.get(h) == block
    assert snaps.held + snaps.pool.free == snaps.num_slots


# ---- GRPO groups -----------------------------------------------------------------------------


def test_a_group_of_eight_computes_its_prompt_once(hf, prompts):
    prompt = prompts[3] + prompts[4]
    engine = DynamicInferenceEngine.from_pretrained(hf, config())
    outs = engine.generate([prompt], SamplingParams(n=8, temperature=0, max_tokens=10, ignore_eos=True))
    assert engine.stats()["prefill_tokens"] == len(prompt)  # once for the group, not 8 times
    assert [o.generated_token_ids for o in outs] == [hf_greedy(hf, prompt, 10)] * 8
    sampled = engine.generate([prompt], SamplingParams(n=8, temperature=1.0, max_tokens=10, seed=3))
    assert len({tuple(o.generated_token_ids) for o in sampled}) > 1  # 8 samples from one forked state
    stats = engine.stats()
    assert stats["state_prefix_hits"] == 1  # the second group found the first's prompt state...
    cached = (len(prompt) - 1) // 4 * 4  # ... at its last full block before the last token
    assert stats["prefix_cached_tokens"] == cached and stats["prefill_tokens"] == 2 * len(prompt) - cached
    assert engine.caches.states.held == 0


# ---- suspend / resume ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(SuspendPolicy))
def test_suspend_resume_cycles_restore_identical_outputs(hf, prompts, uninterrupted, policy):
    engine = DynamicInferenceEngine.from_pretrained(hf, config())
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = []
    for _ in range(6):
        done += engine.step()
        report = engine.suspend(policy)
        assert report.buffer_bytes == engine.caches.nbytes and not engine.caches.states.is_allocated
        engine.resume()
    while engine.has_unfinished_requests():
        done += engine.step()
    by_id = {o.request_id: o.generated_token_ids for o in done}
    for rid, want in zip(ids, uninterrupted):
        got = by_id[rid]
        assert got == (want[: len(got)] if policy is SuspendPolicy.ABORT else want)
    assert engine.caches.states.held == 0 and engine.allocator.active == 0


def test_suspend_frees_kv_and_state_memory_measured_by_rss():
    # a state pool of 1024 slots x 73 KiB (2 Mamba layers, 64-dim SSM state) = 73 MiB, as much again
    # for the snapshots, plus 16 MiB of KV
    hf = tiny_hybrid("bamba", mamba_d_state=64)
    engine = DynamicInferenceEngine.from_pretrained(hf, config(max_requests=1024, max_batch_tokens=1024,
                                                               num_blocks=16384))
    caches = engine.caches
    assert caches.states.nbytes >= 64 * 2**20
    engine.generate([[5, 6, 7, 8, 9, 10, 11]], GREEDY)

    def touch():  # make every page resident, as a long run would
        caches.kv.data.fill_(1.0)
        for pool in (caches.states, caches.snapshots.pool):
            for t in pool.tensors.values():
                t.fill_(1.0)

    touch()
    report = engine.suspend()
    assert report.buffer_bytes == caches.kv.nbytes + caches.states.nbytes + caches.snapshots.nbytes
    assert report.measured_freed_bytes >= 0.95 * report.buffer_bytes
    before = process_rss_bytes()
    engine.resume()
    touch()
    assert process_rss_bytes() - before >= 0.95 * report.buffer_bytes
    print(f"hybrid suspend: {report.buffer_bytes / 2**20:.1f} MiB of KV + state, "
          f"RSS freed {report.measured_freed_bytes / 2**20:.1f} MiB")


# ---- the Mamba side of the prefix cache ------------------------------------------------------


def test_a_weight_update_drops_blocks_and_snapshots(hf, prompts):
    engine = DynamicInferenceEngine.from_pretrained(hf, config(), share_weights=True)
    engine.generate(prompts[:4], GREEDY)
    assert engine.caches.snapshots.held > 0
    engine.on_weights_updated()
    assert engine.caches.snapshots.held == 0 and not engine.allocator.registry.mamba_hash_to_block_id
    engine.generate(prompts[:4], GREEDY)  # the same prompts: nothing matches across the version
    stats = engine.stats()
    assert stats["cross_version_prefix_hits"] == 0 and stats["state_prefix_hits"] == 0
    snapshots_match_registry(engine)


def test_cached_kv_past_the_farthest_snapshot_backs_off(hf):
    base = random_prompts(1, 24, 24, seed=23)[0]
    first, second = base, base[:14] + [7, 8, 9, 10, 11]  # shares 3 full blocks, snapshots at 8, 16, 20
    engine = DynamicInferenceEngine.from_pretrained(hf, config())
    outs = [engine.generate([p], GREEDY)[0].generated_token_ids for p in (first, second)]
    stats = engine.stats()
    assert stats["state_prefix_backoffs"] == 1 and stats["state_prefix_backoff_blocks"] == 1
    assert stats["state_prefix_hits"] == 1 and stats["prefix_cached_tokens"] == 8
    assert outs == [hf_greedy(hf, p, 10) for p in (first, second)]
    # the second recomputed block 2 (cached by the first), held the first's copy instead and went on
    # registering its own blocks, with a snapshot at the branch point (12) and its last full block (16)
    again = engine.generate([second], GREEDY)[0].generated_token_ids
    stats = engine.stats()
    assert again == outs[1] and stats["prefix_cached_tokens"] == 8 + 16 and stats["state_prefix_hits"] == 2


def test_a_small_snapshot_budget_evicts_least_recently_used(hf, prompts, uninterrupted):
    engine = DynamicInferenceEngine.from_pretrained(hf, config(state_snapshot_slots=2))
    got = [engine.generate([p], GREEDY)[0].generated_token_ids for p in prompts]
    assert got == uninterrupted
    assert engine.caches.snapshots.held <= 2 and engine.caches.snapshots.evicted > 0
    snapshots_match_registry(engine)


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_evicting_kv_blocks_evicts_their_snapshots(hf, prompts, uninterrupted, policy):
    engine = DynamicInferenceEngine.from_pretrained(hf, config(num_blocks=24, eviction_policy=policy))
    got = [engine.generate([p], GREEDY)[0].generated_token_ids for p in prompts + prompts[:3]]
    assert got == uninterrupted + uninterrupted[:3]
    assert engine.caches.snapshots.evicted > 0  # with their KV blocks: the budget (16) is never reached
    snapshots_match_registry(engine)
    if policy is EvictionPolicy.REF_ZERO:
        assert engine.caches.snapshots.held == 0  # nothing stays cached once its requests are gone


def test_a_prompt_shorter_than_a_block_cannot_hit_and_the_stats_say_so(hf):
    engine = DynamicInferenceEngine.from_pretrained(hf, config())
    for _ in range(2):  # NOTE: one call each (in one call the second would fork from the first)
        engine.generate([[5, 6, 7, 8]], GREEDY)  # 4 tokens: no full block before the last token
    stats = engine.stats()
    assert stats["prompts_shorter_than_a_block"] == 2 and stats["state_prefix_hits"] == 0
    assert stats["prefix_hit_blocks"] == 0


def test_copied_weight_updates_equal_a_fresh_engine(hf, prompts):
    target = tiny_hybrid("bamba", seed=8)
    engine = DynamicInferenceEngine.from_pretrained(hf, config())  # the engine's own copies
    engine.generate(prompts[:3], GREEDY)
    assert engine.update_weights(dict(target.named_parameters())) == 1
    fresh = DynamicInferenceEngine.from_pretrained(target, config())
    assert [o.generated_token_ids for o in engine.generate(prompts[:3], GREEDY)] == [
        o.generated_token_ids for o in fresh.generate(prompts[:3], GREEDY)]
    assert engine.stats()["state_prefix_hits"] == 0  # nothing computed by the old weights is served


def test_the_engine_aliases_the_trainers_parameters(hf):
    """Aliasing: the engine's tensors are the trainer's parameters (no copy of any)."""
    engine = DynamicInferenceEngine.from_pretrained(hf, config(), share_weights=True)
    params = dict(hf.named_parameters())
    tensors = engine.model.named_tensors()
    assert tensors.keys() <= params.keys()
    assert all(tensors[n].data_ptr() == params[n].data_ptr() for n in tensors)
    assert not engine.model.bind_report.copied
    report = engine.bind_trainer_model(hf)
    assert not report.copied and len(report.aliased) == len(tensors)
    with torch.no_grad():
        hf.model.layers[0].mamba.A_log.add_(0.5)  # a trainer's step, in place
    engine.on_weights_updated()
    out = engine.generate([[5, 6, 7, 8, 9, 10]], GREEDY)[0]
    assert out.generated_token_ids == hf_greedy(hf, [5, 6, 7, 8, 9, 10], 10)
    with torch.no_grad():
        hf.model.layers[0].mamba.A_log.sub_(0.5)
