"""cache_salt: requests with different salts never share prefix-cache blocks; equal salts (or none
on both) share them as before. Outputs are the same whichever way the prefix was had."""

from __future__ import annotations

import pytest

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams
from inference.kv_cache import BlockKey, block_hashes
from tests.inference.engine.conftest import hf_greedy, random_prompts, tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = random_prompts(1, 18, 18, seed=21)[0]  # 4 full blocks of 4 before its last token


def test_salt_keys_every_block_of_the_chain():
    tokens = list(range(3, 3 + 12))
    plain = block_hashes(tokens, 4, extra_key=BlockKey(0).hash_key())
    salted = block_hashes(tokens, 4, extra_key=BlockKey(0, "a").hash_key())
    assert plain == block_hashes(tokens, 4, extra_key=0)  # no salt: the chain as before
    assert not set(plain) & set(salted)
    assert not set(salted) & set(block_hashes(tokens, 4, extra_key=BlockKey(0, "b").hash_key()))
    assert not set(block_hashes(tokens, 4, extra_key=BlockKey(0, "").hash_key())) & set(plain)  # "" is a salt, not None
    assert salted == block_hashes(tokens, 4, extra_key=BlockKey(0, "a").hash_key())


def test_different_salts_never_hit_equal_salts_do():
    model = tiny_llama(layers=1, hidden=32, seed=4)
    engine = DynamicInferenceEngine.from_pretrained(model, InferenceConfig(
        block_size=4, num_blocks=128, max_requests=4, max_batch_tokens=64, max_sequence_length=64))
    want = hf_greedy(model, PROMPT, 4)

    def cached_after(salt):
        before = engine.stats()["prefix_cached_tokens"]
        (out,) = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                          cache_salt=salt))
        assert out.generated_token_ids == want, salt
        return engine.stats()["prefix_cached_tokens"] - before

    assert cached_after("tenant-a") == 0
    assert cached_after("tenant-b") == 0  # same prompt, another salt: no hit
    assert cached_after(None) == 0  # unsalted never hits a salted block
    assert cached_after("tenant-a") == 16  # the same salt: its 4 blocks
    assert cached_after(None) == 16  # both unsalted: as today
    assert cached_after("tenant-b") == 16


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_blocks_filled_while_decoding_are_registered_under_the_chain_and_serve_the_next_turn(salt):
    """A step's newly full blocks (decodes crossing a boundary at different steps, forked samples
    extending their chain past the shared prompt) are registered under the hashes a fresh
    computation gives, so an agent's next turn (prompt + completion + more) is served all of them."""
    model = tiny_llama(layers=1, hidden=32, seed=4)
    engine = DynamicInferenceEngine.from_pretrained(model, InferenceConfig(
        block_size=4, num_blocks=256, max_requests=8, max_batch_tokens=64, max_sequence_length=64))
    prompts = random_prompts(3, 5, 11, seed=3)
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=13, ignore_eos=True,
                                                   cache_salt=salt))
    registered = set(engine.allocator.registry.kv_hash_to_block_id)
    key = BlockKey(0, salt).hash_key()
    for out in outs:
        tokens = out.prompt_token_ids + out.generated_token_ids
        computed = len(tokens) - 1  # NOTE: the last sampled token's K/V is never written
        assert set(block_hashes(tokens[:computed], 4, extra_key=key)) <= registered
        before = engine.stats()["prefix_cached_tokens"]
        engine.generate([tokens + [7]], SamplingParams(temperature=0, max_tokens=1, cache_salt=salt))
        assert engine.stats()["prefix_cached_tokens"] - before == computed // 4 * 4
