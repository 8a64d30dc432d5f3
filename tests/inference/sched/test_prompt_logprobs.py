"""Prompt scores cached per KV block (the seed's `PromptLogprobsBlock`), without an engine.

A request's scores by position go into the blocks it registers and come back out, position for
position, for a request of the same prompt; a block never serves a request it does not fully
cover (more alternatives than cached, its last slot scoring another continuation). The allocator
keeps a block's scores exactly as long as its hash, and keeps the richer of two offers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.kv_cache import (
    MAX_CACHED_PROMPT_TOP_N_LOGPROBS,
    EvictionPolicy,
    KVBlockAllocator,
    PromptLogprobsBlock,
    block_hashes,
)
from inference.sched.prompt_logprobs import PromptScores, block_serves, block_targets


def scored(prompt: list[int], top_n: int, seed: int = 0) -> PromptScores:
    """Scores of every position of `prompt` (random values, as a forward pass would write them)."""
    gen = torch.Generator().manual_seed(seed)
    scores = PromptScores(len(prompt), top_n)
    rows = len(prompt) - 1
    if rows:
        scores.write(1, -torch.rand(rows, generator=gen), -torch.rand(rows, top_n, generator=gen),
                     torch.randint(0, 50, (rows, top_n), generator=gen), torch.randint(1, 50, (rows,), generator=gen))
    return scores


@settings(max_examples=200, deadline=None)
@given(length=st.integers(1, 40), block_size=st.integers(1, 8), top_n=st.integers(0, 4), data=st.data())
def test_scores_round_trip_through_the_blocks_of_a_prompt(length, block_size, top_n, data):
    prompt = data.draw(st.lists(st.integers(0, 50), min_size=length, max_size=length))
    source = scored(prompt, top_n)
    copy = PromptScores(length, data.draw(st.integers(0, top_n)))
    filled = 0
    for index in range(length // block_size):
        block = source.to_block(index, block_size, prompt)
        lo, hi = block_targets(index, block_size, length)
        assert (block is None) == (hi == lo)
        assert block_serves(block, index, block_size, prompt, copy.top_n)
        assert not block_serves(block, index, block_size, prompt, top_n + 1) or hi == lo
        if block is not None:
            filled += copy.fill_from(block, index, block_size)
    assert filled == max(0, min(length - 1, length // block_size * block_size))
    known = copy.known
    assert np.array_equal(copy.logprobs[known], source.logprobs[known])
    assert np.array_equal(copy.ranks[known], source.ranks[known])  # vLLM's rank, whatever top-n the block keeps
    assert np.array_equal(copy.top_ids[known], source.top_ids[known][:, : copy.top_n])
    if filled == length - 1:
        assert copy.as_dicts(prompt)[1:] == [
            {prompt[t]: lp, **dict(zip(ids, tops))} for t, lp, ids, tops in zip(
                range(1, length), source.logprobs[1:].tolist(), source.top_ids[1:, : copy.top_n].tolist(),
                source.top_logprobs[1:, : copy.top_n].tolist())]
        assert copy.ranks_list() == [None, *source.ranks[1:].tolist()]


def test_the_last_slot_serves_only_the_continuation_it_scored():
    prompt = list(range(10, 22))  # 12 tokens, blocks of 4: block 1's last slot scores token 8
    block = scored(prompt, 2).to_block(1, 4, prompt)
    assert block.next_token_id == prompt[8] and bool(block.valid.all())
    assert block_serves(block, 1, 4, prompt, 2)
    assert not block_serves(block, 1, 4, prompt[:8] + [99] + prompt[9:], 2)
    # a prompt that ends inside the block leaves its last slots unscored: no longer prompt served
    short = prompt[:7]
    partial = scored(short, 2).to_block(1, 4, short)
    assert partial.valid.tolist() == [True, True, False, False] and partial.next_token_id == -1
    assert block_serves(partial, 1, 4, short, 2) and not block_serves(partial, 1, 4, prompt, 2)
    assert not block_serves(None, 1, 4, prompt, 0)
    assert scored(prompt, MAX_CACHED_PROMPT_TOP_N_LOGPROBS + 1).to_block(0, 4, prompt) is None


def scores_block(top_n: int, valid: int = 4) -> PromptLogprobsBlock:
    block = PromptLogprobsBlock(4, top_n)
    block.valid[:valid] = True
    return block


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_the_pool_keeps_scores_exactly_as_long_as_the_hash(policy):
    pool = KVBlockAllocator(4, 4, policy)
    hashes = block_hashes(list(range(8)), 4)
    blocks = pool.allocate(2)
    first = scores_block(1)
    assert pool.register(blocks, hashes, prompt_logprobs=[first, None]) == 2
    assert pool.prompt_logprobs_of(blocks[0]) is first and pool.prompt_logprobs_of(blocks[1]) is None
    pool.reset_prefix_cache()  # blocks still held: they keep their owners, lose hash and scores
    assert pool.prompt_logprobs_of(blocks[0]) is None
    pool.release(blocks)
    again = pool.allocate(2)
    pool.register(again, hashes, prompt_logprobs=[scores_block(1), scores_block(1)])
    pool.release(again)
    if policy is EvictionPolicy.LRU:
        assert pool.prompt_logprobs_of(again[1]) is not None  # cached, still matchable
        pool.allocate(4)  # evicts both
    assert not pool.state.prompt_logprobs


def test_offered_scores_are_kept_only_when_they_serve_more():
    pool = KVBlockAllocator(8, 4, EvictionPolicy.LRU)
    hashes = block_hashes(list(range(12)), 4)
    blocks = pool.allocate(2)
    pool.register(blocks, hashes[:2], prompt_logprobs=[scores_block(2), None])
    richer, poorer, partial = scores_block(5), scores_block(1), scores_block(5, valid=2)
    assert pool.offer_prompt_logprobs(hashes, [partial, richer, richer]) == 2  # the third is not cached
    assert pool.prompt_logprobs_of(blocks[0]).top_n == 2  # fewer valid slots: not better
    assert pool.prompt_logprobs_of(blocks[1]) is richer  # had none
    pool.offer_prompt_logprobs(hashes[:1], [richer])
    assert pool.prompt_logprobs_of(blocks[0]) is richer
    pool.offer_prompt_logprobs(hashes[:1], [poorer])
    assert pool.prompt_logprobs_of(blocks[0]) is richer


def test_match_prefix_counts_blocks_left_out_as_misses():
    pool = KVBlockAllocator(8, 4)
    hashes = block_hashes(list(range(12)), 4)
    pool.register(pool.allocate(3), hashes)
    assert len(pool.match_prefix(hashes[:1], looked_up=3)) == 1
    assert (pool.hit_blocks, pool.miss_blocks) == (1, 2)
    assert pool.cached_prefix(hashes) == pool.match_prefix(hashes) and pool.hit_blocks == 4
