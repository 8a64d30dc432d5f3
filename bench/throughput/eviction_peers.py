"""The prefix-cache benchmark's eviction peers, each choosing victims from a snapshot of a pool.

A snapshot (`snapshot_state`) is a copy of the pool's per-block arrays: timestamps, reference
counts, hashes, child counts and parents. Neither peer touches the live pool.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from inference.kv_cache import UNSET_HASH, KVBlockAllocator

_NO_CANDIDATE = np.iinfo(np.int64).max


def naive_evict(snapshot: dict[str, np.ndarray], num_victims: int) -> list[int]:
    """Oldest-first eviction with no index: one full scan of the pool per victim."""
    ts, refs, hashes = snapshot["ts"], snapshot["refs"], snapshot["hashes"]
    children, parents = snapshot["children"], snapshot["parents"]
    victims: list[int] = []
    for _ in range(num_victims):
        candidates = (hashes != UNSET_HASH) & (refs == 0) & (children == 0)
        scored = np.where(candidates, ts, _NO_CANDIDATE)
        victim = int(scored.argmin())
        if scored[victim] == _NO_CANDIDATE:
            break
        victims.append(victim)
        hashes[victim] = UNSET_HASH
        parent = int(parents[victim])
        if parent >= 0:
            children[parent] -= 1
    return victims


def lru_queue(snapshot: dict[str, np.ndarray]) -> OrderedDict[int, None]:
    """The OrderedDict LRU peer's queue over the snapshot: evictable blocks in eviction order.

    Eviction order: oldest timestamp first; within one timestamp deeper blocks first, so a chain
    leaves tail first, as blocks released together enter a free-block queue.
    """
    ts, refs, hashes, parents = snapshot["ts"], snapshot["refs"], snapshot["hashes"], snapshot["parents"]
    depth, up = np.zeros(len(ts), dtype=np.int64), parents.copy()
    while (has := up >= 0).any():
        depth[has] += 1
        up[has] = parents[up[has]]
    ids = np.flatnonzero((hashes != UNSET_HASH) & (refs == 0))
    ids = ids[np.lexsort((ids, -depth[ids], ts[ids]))]
    return OrderedDict.fromkeys(ids.tolist())


def lru_evict(queue: OrderedDict[int, None], num_victims: int) -> list[int]:
    """The OrderedDict LRU peer's choice of victims: pop the head of the queue."""
    return [queue.popitem(last=False)[0] for _ in range(num_victims)]


def lru_victims_valid(snapshot: dict[str, np.ndarray], theirs: list[int], ours: list[int]) -> bool:
    """Each of `theirs` was an evictable leaf when taken, and its timestamp is that of ours at the same rank."""
    ts, refs, hashes = snapshot["ts"], snapshot["refs"], snapshot["hashes"].copy()
    children, parents = snapshot["children"].copy(), snapshot["parents"]
    if len(theirs) != len(ours) or ts[theirs].tolist() != ts[ours].tolist():
        return False
    for victim in theirs:
        if hashes[victim] == UNSET_HASH or refs[victim] != 0 or children[victim] != 0:
            return False
        hashes[victim] = UNSET_HASH
        if parents[victim] >= 0:
            children[parents[victim]] -= 1
    return True


def snapshot_state(alloc: KVBlockAllocator) -> dict[str, np.ndarray]:
    state = alloc.state
    return {
        "ts": state._timestamps.copy(),
        "refs": state._refs.copy(),
        "hashes": state._hashes.copy(),
        "children": state._child_counts.copy(),
        "parents": state._parents.copy(),
    }
