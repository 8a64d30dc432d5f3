"""KV events at engine level (`InferenceConfig.record_kv_events`): what a prefix-aware router sees.

Stored events name exactly the blocks the engine can serve (hashes as the router computes them
from the tokens and the policy version), only after the forward that wrote them; evictions are
announced as removed; a weight update clears everything. The check is run once more against a
planted bug and must catch it.
"""

from __future__ import annotations

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, block_hashes
from tests.inference.engine.conftest import random_prompts, tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 4
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def engine_for(**overrides) -> DynamicInferenceEngine:
    fields = dict(block_size=BS, num_blocks=16, max_requests=4, max_batch_tokens=64, max_sequence_length=64,
                  record_kv_events=True)
    fields.update(overrides)
    return DynamicInferenceEngine.from_pretrained(tiny_llama(seed=14), InferenceConfig(**fields))


def served_hashes(out, version):
    """Hashes of the full blocks whose K/V a finished request computed (all tokens but the last)."""
    tokens = out.prompt_token_ids + out.generated_token_ids
    full = (len(tokens) - 1) // BS * BS
    return block_hashes(tokens[:full], BS, extra_key=version)


def check_events():
    engine = engine_for()
    prompts = random_prompts(2, 9, 12, seed=91)
    outs = engine.generate(prompts, PARAMS)
    events = engine.allocator.events.take_events()
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert sorted(stored) == sorted(h for o in outs for h in served_hashes(o, 0))
    assert all(isinstance(e, BlockStored) for e in events)
    # a step whose forward fails announces nothing
    forward = engine.runner.forward
    engine.runner.forward = lambda batch: (_ for _ in ()).throw(RuntimeError("device lost"))
    with pytest.raises(RuntimeError):
        engine.generate([random_prompts(1, 12, 12, seed=92)[0]], PARAMS)
    assert not [e for e in engine.allocator.events.take_events() if isinstance(e, BlockStored)]
    engine.runner.forward = forward
    # pressure: new prompts evict cached blocks, announced as removed (only hashes once stored)
    more = engine.generate(random_prompts(3, 14, 16, seed=93), PARAMS)
    events = engine.allocator.events.take_events()
    removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    stored += [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert removed & set(stored[:4]) and removed <= set(stored)
    # a weight update: everything announced before is gone, and says so
    engine.update_weights(tiny_llama(seed=15).named_parameters())
    events = engine.allocator.events.take_events()
    assert events and isinstance(events[-1], AllBlocksCleared), "no AllBlocksCleared after a weight update"
    outs = engine.generate(prompts[:1], PARAMS)
    stored = [h for e in engine.allocator.events.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == served_hashes(outs[0], engine.policy_version) and engine.policy_version == 1
    assert more and not set(stored) & {h for o in more for h in served_hashes(o, 0)}


def test_kv_events_announce_what_the_engine_can_serve():
    check_events()


def test_no_events_unless_asked():
    engine = engine_for(record_kv_events=False)
    engine.generate(random_prompts(2, 9, 12, seed=91), PARAMS)
    engine.update_weights(tiny_llama(seed=15).named_parameters())
    assert engine.allocator.events.take_events() == []


@pytest.fixture
def planted_update_clears_silently(monkeypatch):
    """Planted bug: a prefix-cache reset does not tell the router (it keeps routing to stale blocks)."""
    monkeypatch.setattr("inference.kv_cache.events.KVEventHub.all_cleared", lambda self: None)


def test_the_event_check_catches_a_silent_reset(planted_update_clears_silently):
    with pytest.raises(AssertionError, match="AllBlocksCleared"):
        check_events()
