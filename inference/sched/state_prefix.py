"""Prefix caching for models with per-request state (hybrid Mamba): what a request may take from
the cache, where its prefill chunks end, and which of its states are kept.

A KV prefix is worth something to a hybrid only with the recurrent state after exactly that
prefix. So:
* a prefill chunk ends on a KV block boundary when it can (the end of the known tokens aside),
  at the last block boundary before the last token (the longest prefix the same prompt can
  match again), and where the request's cached KV ended but no state snapshot did (the branch
  point of the cached prefixes: the next request that shares this much finds the state there),
  so the state at these boundaries exists at the end of some forward pass;
* after the forward, each prefill chunk that ended on a boundary whose block hash the KV cache
  serves leaves a snapshot of the request's state under that hash (`StateSnapshots`);
* a new request takes the longest cached KV prefix that ends at a cached snapshot: the
  registry's `find_mamba_backoff` gives the farthest snapshot within its cached KV, the KV
  blocks past it are given up (and recomputed), and the snapshot is copied into its state rows.
A prompt shorter than one block (plus its last token) has no full block to match, as with KV.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from inference.cache.snapshots import StateSnapshots
from inference.cache.state_pool import StatePool
from inference.kv_cache.allocator import KVBlockAllocator


class StatePrefixCache:
    """The state side of admission, chunking and registration (see module docstring).

    Counters: `lookups` admissions with at least one full block to match, `hits` those that
    restored a snapshot, `backoffs` those whose cached KV reached past their farthest snapshot
    (`backoff_blocks` cached blocks given up), `too_short` admissions without a full block.
    """

    def __init__(self, snapshots: StateSnapshots, states: StatePool, allocator: KVBlockAllocator,
                 block_size: int) -> None:
        self.snapshots = snapshots
        self.states = states
        self.allocator = allocator
        self.block_size = block_size
        self.lookups = 0
        self.hits = 0
        self.backoffs = 0
        self.backoff_blocks = 0
        self.too_short = 0

    def usable(self, hashes: list[int]) -> tuple[list[int], int]:
        """(the leading `hashes` a request may take: cached KV ending at a cached state, how many
        blocks the KV cache has beyond them)."""
        cached = len(self.allocator.cached_prefix(hashes))
        usable = self.allocator.registry.find_mamba_backoff(hashes, cached)
        return hashes[:usable], cached - usable

    def admitted(self, hashes: list[int], num_matched: int, given_up: int, state_slot: int) -> None:
        """A request entered `state_slot` with `num_matched` cached blocks of its `hashes`: its state
        is the snapshot at their end (the slot was zeroed; with no match it starts from zeros)."""
        if not hashes:
            self.too_short += 1
            return
        self.lookups += 1
        if given_up:
            self.backoffs += 1
            self.backoff_blocks += given_up
        if num_matched:
            if not self.snapshots.restore(hashes[num_matched - 1], self.states, state_slot):
                raise RuntimeError("a matched KV prefix lost its state snapshot during admission")  # a bug
            self.hits += 1

    def chunk(self, kv_len: int, chunk: int, num_tokens: int, branch: int = 0) -> int:
        """`chunk` cut to end on a block boundary: the `branch` point or the last one before the last
        token if one falls inside, else the last one it reaches (unless it reaches the end)."""
        bs = self.block_size
        end = kv_len + chunk
        for point in (branch, (num_tokens - 1) // bs * bs):
            if kv_len < point < end:
                return point - kv_len
        if end < num_tokens and end // bs * bs > kv_len:
            return end // bs * bs - kv_len
        return chunk

    def snapshot(self, slots: list[int], kv_len: np.ndarray, cacheable: np.ndarray, state_slot: np.ndarray,
                 chain_of: Callable[[int], list[int]], hashes_of: Callable[[int], list[int]]) -> int:
        """After a forward: keep the state of each prefill slot whose chunk ended on a block boundary
        the KV cache serves. A boundary's hash is the slot's registered chain's, else its
        matchable hashes' (a chain stops where the cache refused a block another one serves).
        Returns how many snapshots were taken."""
        bs, taken = self.block_size, 0
        serving = self.allocator.registry.kv_hash_to_block_id
        for slot in slots:
            kv = int(kv_len[slot])
            if kv % bs or kv == 0 or not cacheable[slot]:
                continue
            index = kv // bs - 1
            hashes = chain_of(slot)
            if index >= len(hashes):
                hashes = hashes_of(slot)
                if index >= len(hashes):
                    continue
            block = serving.get(hashes[index])
            if block is not None:
                taken += self.snapshots.save(self.states, int(state_slot[slot]), block, hashes[index])
        return taken

    def stats(self) -> dict:
        return {"state_prefix_lookups": self.lookups, "state_prefix_hits": self.hits,
                "state_prefix_backoffs": self.backoffs, "state_prefix_backoff_blocks": self.backoff_blocks,
                "prompts_shorter_than_a_block": self.too_short}
