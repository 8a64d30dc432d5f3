"""Requests of random lengths through a 64-block pool: nothing lost, nothing leaked (300 in `make test`,
2,000 under `stress`)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from inference import ContextOverflowError, DynamicInferenceEngine, EvictionPolicy, InferenceConfig, SamplingParams
from inference.kv_cache.hashing import UNSET_HASH
from tests.inference.engine.conftest import VOCAB, tiny_llama


def check_invariants(engine: DynamicInferenceEngine) -> None:
    """Slot block tables account for every reference; the pool's three places partition it."""
    ctx, pool = engine.context, engine.allocator
    held = Counter()
    for slot in ctx.active + ctx.paused:
        held.update(ctx.block_table[slot, : ctx.num_blocks[slot]].tolist())
    refs = pool.state.block_ref_counts.numpy()
    assert (refs >= 0).all()
    expected = np.zeros_like(refs)
    for block, count in held.items():
        expected[block] = count
    assert (refs == expected).all()
    free = set(pool.free_block_ids())
    assert len(free) == pool.free and not free & set(held)
    assert pool.free + pool.active + pool.cached == pool.total
    hashes = pool.state.block_hashes.numpy()
    assert all(hashes[b] == UNSET_HASH for b in free)
    assert sorted(pool.registry.kv_hash_to_block_id.values()) == sorted(np.flatnonzero(hashes != UNSET_HASH).tolist())
    assert set(ctx.free_slots).isdisjoint(ctx.active + ctx.paused)
    assert len(ctx.free_slots) + len(ctx.active) + len(ctx.paused) == engine.config.max_requests


@pytest.mark.parametrize("count", [300, pytest.param(2000, marks=pytest.mark.stress)])
@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_requests_through_64_blocks(policy, count):
    rng = random.Random(11)
    engine = DynamicInferenceEngine.from_pretrained(
        tiny_llama(layers=1, hidden=32),
        InferenceConfig(block_size=4, num_blocks=64, max_requests=32, max_batch_tokens=64, chunked_prefill_size=16,
                        max_sequence_length=96, eviction_policy=policy),
    )
    shared_prefix = [rng.randrange(3, VOCAB) for _ in range(12)]
    added, rejected, outputs = {}, 0, []
    step = 0
    while len(added) + rejected < count or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4) if len(added) + rejected < count else 0):
            prompt = ([] if rng.random() < 0.5 else shared_prefix) + [
                rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 60))
            ]
            params = SamplingParams(n=rng.choice([1, 1, 1, 2, 4]), temperature=rng.choice([0.0, 1.0]),
                                    max_tokens=rng.randrange(1, 60), ignore_eos=rng.random() < 0.8)
            try:
                ids = engine.add_request(prompt, params)
            except ContextOverflowError as exc:
                assert not exc.is_transient
                rejected += 1
                continue
            for rid in ids if isinstance(ids, list) else [ids]:
                added[rid] = params
        if added and rng.random() < 0.02:
            engine.abort(rng.choice(list(added)))
        outputs += engine.step()
        step += 1
        if step % 25 == 0:
            check_invariants(engine)
    outputs += engine.step()
    check_invariants(engine)
    by_id = {o.request_id: o for o in outputs}
    assert len(by_id) == len(outputs) == len(added)  # every request exactly once
    for rid, params in added.items():
        out = by_id[rid]
        assert out.finish_reason.value in ("stop", "length", "abort")
        if out.finish_reason.value == "length":
            assert len(out.generated_token_ids) == params.max_tokens
    assert rejected > 0 and any(o.num_preemptions for o in outputs)
    pool = engine.allocator
    assert pool.active == 0
    if policy is EvictionPolicy.REF_ZERO:
        assert pool.free == pool.total and not pool.registry.kv_hash_to_block_id
    else:
        assert pool.free + pool.cached == pool.total
