"""The SALTED prefix-cache policy on a real model: a session's later turns reuse its blocks across
weight updates (RESET's do not), every output still equals HF's (the weights do not change here,
so reused K/V is exact), `max_staleness` restarts or refuses stale sessions, KV events and stats
name each block's key and version."""

from __future__ import annotations

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.config import PrefixCachePolicy, StalePolicy
from inference.errors import StaleSessionError
from inference.kv_cache import BlockStored
from tests.inference.engine.conftest import hf_greedy, random_prompts, tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = random_prompts(1, 18, 18, seed=21)[0]  # 4 full blocks of 4 before its last token
MODEL = tiny_llama(layers=1, hidden=32, seed=4)
WANT = hf_greedy(MODEL, PROMPT, 4)


def engine_of(**config) -> DynamicInferenceEngine:
    return DynamicInferenceEngine.from_pretrained(MODEL, InferenceConfig(
        block_size=4, num_blocks=128, max_requests=4, max_batch_tokens=64, max_sequence_length=64,
        record_kv_events=True, **config))


def cached_turn(engine, session="agent-1", **params) -> int:
    before = engine.stats()["prefix_cached_tokens"]
    (out,) = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                      session_id=session, **params))
    assert out.generated_token_ids == WANT
    return engine.stats()["prefix_cached_tokens"] - before


def test_a_salted_session_keeps_its_blocks_across_updates_a_reset_one_does_not():
    salted, reset = engine_of(prefix_cache_policy=PrefixCachePolicy.SALTED), engine_of()
    for engine in (salted, reset):
        assert cached_turn(engine) == 0
        engine.on_weights_updated()
    assert cached_turn(salted) == 16 and salted.stats()["cross_version_prefix_hits"] == 4
    assert cached_turn(reset) == 0 and reset.stats()["cross_version_prefix_hits"] == 0
    assert cached_turn(salted, session="agent-2") == 0  # a new session starts under the current version
    # prompt and answer: 22 tokens, 5 full blocks per version (the second turn decoded the 5th under v1)
    assert salted.stats()["prefix_blocks_version_0"] == 5 and salted.stats()["prefix_blocks_version_1"] == 5
    # per request: a RESET request in a SALTED engine reads only blocks the current weights computed
    assert cached_turn(salted, session=None, prefix_cache_policy=PrefixCachePolicy.RESET) == 16  # agent-2's, v1
    salted.on_weights_updated()
    assert cached_turn(salted, session=None, prefix_cache_policy=PrefixCachePolicy.RESET) == 0
    assert cached_turn(salted) == 16  # agent-1 still reads its own


def test_kv_events_carry_salt_key_version_and_computing_version():
    engine = engine_of(prefix_cache_policy=PrefixCachePolicy.SALTED)
    engine.on_weights_updated()
    cached_turn(engine, cache_salt="tenant")
    stored = [e for e in engine.core.allocator.events.take_events() if isinstance(e, BlockStored)]
    assert stored and all((e.salt, e.version, e.computed_by) == ("tenant", 1, 1) for e in stored)


@pytest.mark.parametrize("policy", list(StalePolicy))
def test_a_session_past_max_staleness_is_restarted_or_refused(policy):
    engine = engine_of(prefix_cache_policy=PrefixCachePolicy.SALTED, max_staleness=1, stale_policy=policy)
    cached_turn(engine)
    engine.on_weights_updated()
    assert cached_turn(engine) == 16  # one version behind: within the bound
    engine.on_weights_updated()  # two behind: past it, before any turn is prefilled again
    assert "prefix_blocks_version_0" not in engine.stats()  # freed at once past max_staleness
    if policy is StalePolicy.RECOMPUTE:
        assert cached_turn(engine) == 0  # starts again under version 2, from its whole prompt
        assert cached_turn(engine) == 16
    else:
        with pytest.raises(StaleSessionError, match="agent-1"):
            cached_turn(engine)
        assert engine.end_session("agent-1") is False  # forgotten already, no longer refused
        assert cached_turn(engine) == 0
