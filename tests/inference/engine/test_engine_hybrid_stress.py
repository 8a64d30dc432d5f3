"""500 requests through a hybrid Mamba model and a small pool: random lengths, n in {1, 2, 4},
aborts, shared prefixes. Nothing lost, no KV block, state slot or snapshot slot leaked."""

from __future__ import annotations

import random
import time

import pytest

from inference import ContextOverflowError, DynamicInferenceEngine, EvictionPolicy, InferenceConfig, SamplingParams
from tests.inference.engine.test_engine_hybrid import snapshots_match_registry
from tests.inference.engine.test_engine_stress import check_invariants
from tests.inference.models.hybrid.tiny import VOCAB, tiny_hybrid

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_state_invariants(engine: DynamicInferenceEngine) -> None:
    """Each request in a slot holds its own state row; free rows are exactly the others."""
    ctx, states = engine.context, engine.caches.states
    rows = [int(ctx.state_slot[s]) for s in ctx.active + ctx.paused]
    assert len(set(rows)) == len(rows) and -1 not in rows
    assert states.held == len(rows) and not set(rows) & set(states._free)
    snapshots_match_registry(engine)


def run_stress(requests: int, policy: EvictionPolicy, seed: int = 5) -> dict:
    rng = random.Random(seed)
    hf = tiny_hybrid("nemotron_h", seed=seed, layers_block_type=["linear_attention", "full_attention"],
                     hidden_size=32, intermediate_size=32, mamba_num_heads=4, mamba_head_dim=16)
    engine = DynamicInferenceEngine.from_pretrained(hf, InferenceConfig(
        block_size=4, num_blocks=96, max_requests=24, max_batch_tokens=64, chunked_prefill_size=16,
        max_sequence_length=96, eviction_policy=policy, state_snapshot_slots=12))
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    added, rejected, outputs, aborted = {}, 0, [], 0
    start, step = time.perf_counter(), 0
    while len(added) + rejected < requests or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4) if len(added) + rejected < requests else 0):
            head = rng.choice(prefixes) if rng.random() < 0.6 else []
            prompt = head + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))]
            params = SamplingParams(n=rng.choice([1, 2, 4]), temperature=rng.choice([0.0, 1.0]),
                                    max_tokens=rng.randrange(1, 40), ignore_eos=rng.random() < 0.8)
            try:
                ids = engine.add_request(prompt, params)
            except ContextOverflowError as exc:
                assert not exc.is_transient
                rejected += 1
                continue
            for rid in ids if isinstance(ids, list) else [ids]:
                added[rid] = params
        if added and rng.random() < 0.03:
            aborted += engine.abort(rng.choice(list(added)))
        outputs += engine.step()
        step += 1
        if step % 20 == 0:
            check_invariants(engine)
            check_state_invariants(engine)
    outputs += engine.step()
    check_invariants(engine)
    check_state_invariants(engine)
    by_id = {o.request_id: o for o in outputs}
    assert len(by_id) == len(outputs) == len(added)  # every request exactly once
    for rid, params in added.items():
        out = by_id[rid]
        assert out.finish_reason.value in ("stop", "length", "abort")
        if out.finish_reason.value == "length":
            assert len(out.generated_token_ids) == params.max_tokens
    assert engine.caches.states.held == 0 and engine.allocator.active == 0
    stats = engine.stats()
    assert stats["state_prefix_hits"] > 0 and any(o.num_preemptions for o in outputs) and aborted > 0
    return dict(requests=len(added), rejected=rejected, aborted=aborted, steps=step,
                seconds=round(time.perf_counter() - start, 1), preemptions=stats["preemptions"],
                mamba_hits=stats["state_prefix_hits"], backoffs=stats["state_prefix_backoffs"],
                snapshots_evicted=stats["state_snapshots_evicted"])


def test_five_hundred_requests_through_a_hybrid():
    print("hybrid stress (lru):", run_stress(500, EvictionPolicy.LRU))


@pytest.mark.stress
@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_five_thousand_requests_through_a_hybrid(policy):
    print(f"hybrid stress ({policy.value}):", run_stress(2500, policy, seed=6))
