"""Suspend under OFFLOAD: the slots keep their requests while the KV pool is reset under them.

`detach_blocks` marks the slots' blocks as no longer referenced (the pool reset took them), so a
request aborted meanwhile frees nothing; `reattach_blocks` gives the slots fresh blocks on resume
and says where each saved block's contents must be copied. Functions over the context's slots.
"""

from __future__ import annotations

import numpy as np

from inference.sched.context import DynamicInferenceContext


def held_block_ids(ctx: DynamicInferenceContext) -> np.ndarray:
    """Distinct blocks held by the requests in slots (sorted), e.g. to copy them to host."""
    slots = ctx.active + ctx.paused
    if not slots:
        return np.empty(0, dtype=np.int64)
    return np.unique(np.concatenate([ctx.block_table[s, : ctx.num_blocks[s]] for s in slots])).astype(np.int64)


def detach_blocks(ctx: DynamicInferenceContext) -> None:
    """The pool was reset under the slots (suspend OFFLOAD): their tables now name blocks
    they hold no reference on. Until `reattach_blocks`, releasing a slot frees nothing."""
    ctx.blocks_detached = True


def reattach_blocks(ctx: DynamicInferenceContext, offloaded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Give the slots fresh blocks for the detached ones they still hold (resume).

    `offloaded` lists the (sorted) detached block ids whose contents were saved; requests
    released meanwhile (aborted) no longer hold theirs. Every slot's table is rewritten to the
    fresh ids, and each fresh block gets one reference per slot holding it (a group's shared
    prompt blocks stay shared). Their hash chains left the registry with the reset, so they
    stay private. Returns `(fresh, rows)`: block `offloaded[rows[i]]` moves to `fresh[i]`.
    """
    ctx.blocks_detached = False
    held = held_block_ids(ctx)
    rows = np.searchsorted(offloaded, held)
    fresh = np.array(ctx.allocator.allocate(held.size), dtype=np.int64)
    if held.size == 0:
        return fresh, rows
    new_id = np.full(ctx.allocator.total, -1, dtype=np.int64)
    new_id[held] = fresh
    slots = ctx.active + ctx.paused
    for slot in slots:
        n = int(ctx.num_blocks[slot])
        ctx.block_table[slot, :n] = new_id[ctx.block_table[slot, :n]]
    counts = np.bincount(np.concatenate([ctx.block_table[s, : ctx.num_blocks[s]] for s in slots]),
                         minlength=ctx.allocator.total)
    extra = np.repeat(np.arange(counts.size), np.maximum(counts - 1, 0))
    if extra.size:
        ctx.allocator.retain(extra.tolist())
    ctx.cache_broken[slots] = True
    ctx.offers_scores[slots] = False
    ctx.state_cacheable[slots] = False
    return fresh, rows

