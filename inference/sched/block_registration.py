"""Registering the blocks a forward pass completed, so later requests can match them.

Functions over the context's per-slot hash state (`hashes`, `num_registered`, `cache_broken`,
`offers_scores`), called by the engine core once per step, after the forward pass that wrote
the blocks succeeded (KV events are announced only then).
"""

from __future__ import annotations

import numpy as np

from inference.kv_cache.hashing import block_hashes
from inference.sched.context import DynamicInferenceContext, request_chain_key


def register_full_blocks(ctx: DynamicInferenceContext, slots: np.ndarray) -> None:
    """Register the blocks of `slots` whose K/V became complete in the last forward pass.

    A slot's hash chain is extended lazily from its tokens (a forked sample computes the
    shared prompt part once, when its first own block fills). Once the allocator refuses a
    block (parent unregistered after a reset, or the hash already served by another block),
    the rest of that request's blocks stay private.
    """
    if not ctx.allocator.enable_prefix_caching:
        return
    bs = ctx.block_size
    crossed = slots[ctx.kv_len[slots] // bs > ctx.num_registered[slots]]  # few: ~1 in bs per step
    for slot in crossed.tolist():
        full = int(ctx.kv_len[slot]) // bs
        done = int(ctx.num_registered[slot])
        ctx.num_registered[slot] = full
        if ctx.cache_broken[slot] and not ctx.offers_scores[slot]:
            continue
        chain = ctx.hashes[slot]
        parent_hash = chain[-1] if chain else 0
        new_tokens = ctx.tokens[slot, len(chain) * bs : full * bs].tolist()
        req = ctx.requests[slot]
        key = request_chain_key(ctx.policy_version, req)  # NOTE: matchable_hashes keys it alike
        chain.extend(block_hashes(new_tokens, bs, parent_hash, key))
        scores = req.prompt_scores
        # NOTE: the scores of these blocks were recorded from the same forward pass, just before
        cached_scores = None if scores is None else [
            scores.to_block(index, bs, req.prompt_token_ids) for index in range(done, full)]
        if ctx.offers_scores[slot]:
            _offer_scores(ctx, slot, chain[done:full], cached_scores)
            continue
        parent = int(ctx.block_table[slot, done - 1]) if done else -1
        ids = ctx.block_table[slot, done:full].tolist()
        registered = ctx.allocator.register(ids, chain[done:full], parent, prompt_logprobs=cached_scores)
        ctx.block_version[ids[:registered]] = ctx.policy_version
        if registered < full - done and scores is None and ctx.state_prefix is not None:
            registered = _adopt_served_blocks(ctx, slot, chain, done + registered, full) - done
        if registered < full - done:
            ctx.cache_broken[slot] = True
            if scores is not None:  # NOTE: typically its hash is served by a block cached without scores
                ctx.offers_scores[slot] = True
                _offer_scores(ctx, slot, chain[done + registered : full], cached_scores[registered:])


def _adopt_served_blocks(ctx: DynamicInferenceContext, slot: int, chain: list[int], pos: int, full: int) -> int:
    """Blocks `pos..full-1` of `slot` were refused because other blocks serve their hashes (it
    recomputed a cached prefix past its farthest state snapshot): hold those instead and go on
    registering its own, so its chain stays in the cache. Returns how far the chain got."""
    registered = ctx.allocator.registry.kv_hash_to_block_id
    if pos and registered.get(chain[pos - 1]) != int(ctx.block_table[slot, pos - 1]):
        return pos  # NOTE: refused for another reason (its parent is not in the cache)
    while pos < full:
        served = ctx.allocator.adopt(chain[pos], int(ctx.block_table[slot, pos]))
        if served is None:
            return pos
        ctx.block_table[slot, pos] = served
        pos += 1
        ids = ctx.block_table[slot, pos:full].tolist()
        count = ctx.allocator.register(ids, chain[pos:full], served)
        ctx.block_version[ids[:count]] = ctx.policy_version
        pos += count
    return pos


def _offer_scores(ctx: DynamicInferenceContext, slot: int, hashes: list[int], cached_scores: list) -> None:
    """Cache the slot's prompt scores with the registered blocks that serve its hashes, until
    its chain leaves the cache."""
    if ctx.allocator.offer_prompt_logprobs(hashes, cached_scores) < len(hashes):
        ctx.offers_scores[slot] = False
