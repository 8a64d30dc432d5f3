"""Registering the blocks a forward pass completed, so later requests can match them.

Functions over the context's per-slot hash state (`hashes`, `num_registered`, `cache_broken`,
`offers_scores`), called by the engine core once per step, after the forward pass that wrote
the blocks succeeded (KV events are announced only then).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from inference.kv_cache.allocator import BlockRun
from inference.kv_cache.block_key import BlockKey
from inference.kv_cache.hashing import chained_hash, packed_block_hashes
from inference.sched.context import DynamicInferenceContext


def register_full_blocks(ctx: DynamicInferenceContext, slots: np.ndarray) -> None:
    """Register the blocks of `slots` whose K/V became complete in the last forward pass.

    A slot's hash chain is extended lazily from its tokens (a forked sample computes the
    shared prompt part once, when its first own block fills). Once the allocator refuses a
    block (parent unregistered after a reset, or the hash already served by another block),
    the rest of that request's blocks stay private. The step's runs go to the allocator in one
    call, in slot order, as if registered one by one (a refused run is dealt with before the
    runs after it).
    """
    if not ctx.allocator.enable_prefix_caching:
        return
    bs = ctx.block_size
    crossed = slots[ctx.kv_len[slots] // bs > ctx.num_registered[slots]]  # few: ~1 in bs per step
    if not crossed.size:
        return
    fulls = ctx.kv_len[crossed] // bs
    dones = ctx.num_registered[crossed]
    ctx.num_registered[crossed] = fulls
    skipped = (ctx.cache_broken[crossed] & ~ctx.offers_scores[crossed]).tolist()
    # NOTE: each slot's first new block, gathered at once: a decode step's only one
    first_ids = ctx.block_table[crossed, dones].tolist()
    parents = np.where(dones > 0, ctx.block_table[crossed, np.maximum(dones - 1, 0)], -1).tolist()
    packed = ctx.tokens[crossed[:, None], dones[:, None] * bs + np.arange(bs)].tobytes()
    stride = bs * ctx.tokens.itemsize  # NOTE: int64, as packed_block_hashes reads them
    pending = _Pending()
    version = ctx.policy_version
    # NOTE: a slot keyed by the version alone, without prompt scores or offers: its request is not read
    plain = (ctx.plain_key[crossed] & ~ctx.wants_prompt_logprobs[crossed] & ~ctx.offers_scores[crossed]).tolist()
    plain_key, plain_salt = ctx.plain_chain_key(version)
    for i, (slot, full, done) in enumerate(zip(crossed.tolist(), fulls.tolist(), dones.tolist())):
        if skipped[i]:
            continue
        chain = ctx.hashes[slot]
        req = None if plain[i] else ctx.requests[slot]
        key, salt = (plain_key, plain_salt) if req is None else ctx.chain_key(req, version)  # NOTE: as matchable_hashes
        if len(chain) == done and full == done + 1:  # NOTE: a decode's block, the usual case
            chain.append(chained_hash(chain[-1] if chain else 0, salt, packed[i * stride : (i + 1) * stride]))
            ids = [first_ids[i]]
        else:  # NOTE: a prefill's blocks, or a forked sample's first own one (its chain is extended lazily)
            new_tokens = ctx.tokens[slot, len(chain) * bs : full * bs]
            chain += packed_block_hashes(new_tokens.tobytes(), bs, chain[-1] if chain else 0, salt)
            ids = ctx.block_table[slot, done:full].tolist()
        scores = None if req is None else req.prompt_scores
        # NOTE: the scores of these blocks were recorded from the same forward pass, just before
        cached_scores = None if scores is None else [
            scores.to_block(index, bs, req.prompt_token_ids) for index in range(done, full)]
        if req is not None and ctx.offers_scores[slot]:
            _register_pending(ctx, pending)  # NOTE: what it offers to may be registered this step
            _offer_scores(ctx, slot, chain[done:full], cached_scores)
            continue
        pending.runs.append(BlockRun(ids, chain[done:full], parents[i], key, cached_scores))
        pending.spans.append((slot, done, full))
    _register_pending(ctx, pending)


@dataclass(slots=True)
class _Pending:
    """Slots' runs of blocks (`spans[i]` = slot, done, full: its blocks `done..full-1`), waiting for
    the step's one call to the allocator."""

    runs: list[BlockRun] = field(default_factory=list)
    spans: list[tuple[int, int, int]] = field(default_factory=list)


def _register_pending(ctx: DynamicInferenceContext, pending: _Pending) -> None:
    """Register the runs of `pending` in order (emptying it); a slot whose run is refused in part
    holds the blocks serving its hashes if it can, else its chain stays private from there."""
    start = 0
    while start < len(pending.runs):
        counts = ctx.allocator.register_runs(pending.runs[start:], computed_by=ctx.policy_version)
        start += len(counts)
        run, (slot, done, full) = pending.runs[start - 1], pending.spans[start - 1]
        registered = counts[-1]
        if registered == full - done:
            continue
        scores = ctx.requests[slot].prompt_scores
        if scores is None and ctx.state_prefix is not None:
            registered = _adopt_served_blocks(ctx, slot, ctx.hashes[slot], done + registered, full, run.key) - done
        if registered < full - done:
            ctx.cache_broken[slot] = True
            if scores is not None:  # NOTE: typically its hash is served by a block cached without scores
                ctx.offers_scores[slot] = True
                _offer_scores(ctx, slot, run.hashes[registered:], run.prompt_logprobs[registered:])
    pending.runs.clear()
    pending.spans.clear()


def _adopt_served_blocks(ctx: DynamicInferenceContext, slot: int, chain: list[int], pos: int, full: int,
                         key: BlockKey) -> int:
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
        count = ctx.allocator.register(ids, chain[pos:full], served, key=key, computed_by=ctx.policy_version)
        pos += count
    return pos


def _offer_scores(ctx: DynamicInferenceContext, slot: int, hashes: list[int], cached_scores: list) -> None:
    """Cache the slot's prompt scores with the registered blocks that serve its hashes, until
    its chain leaves the cache."""
    if ctx.allocator.offer_prompt_logprobs(hashes, cached_scores) < len(hashes):
        ctx.offers_scores[slot] = False
