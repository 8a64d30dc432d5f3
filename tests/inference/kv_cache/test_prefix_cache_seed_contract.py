"""The seed pages' contract where a list-typed, self-mutating reading would differ.

Return types are the ones the seed documents (tensors of block ids), REF_ZERO releases report
the -1 of unhashed blocks, `deregister_blocks` resets the whole per-block state, the evictable
count reads the public tensors, `find_lru_evictable` only looks, and a registry reset is no
eviction. A property test drives random block lifecycles to check the query/eviction pairing.
"""

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from inference.kv_cache.block_state import PrefixCacheBlockState
from inference.kv_cache.hashing import UNSET_HASH
from inference.kv_cache.policy import EvictionPolicy
from inference.kv_cache.registry import PrefixCacheRegistry

LRU, REF_ZERO = EvictionPolicy.LRU, EvictionPolicy.REF_ZERO


def _ids(*block_ids: int) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.int64)


def _lru_chain(state, block_ids, first_hash, clocks):
    """Blocks allocated at `clocks`, registered as one chain rooted at the first, then released."""
    for block_id, clock in zip(block_ids, clocks):
        state.on_allocate(_ids(block_id), clock)
    state.stamp_block_hashes(list(block_ids), [first_hash + i for i in range(len(block_ids))])
    state.record_parent_chain(list(block_ids), [-1] + list(block_ids[:-1]))
    state.on_release_compute_pool_returns(_ids(*block_ids))


def _public(state):
    stamps = state.block_timestamps
    return (
        state.block_hashes.tolist(),
        state.block_ref_counts.tolist(),
        None if stamps is None else stamps.tolist(),
        sorted(state._lru_heap),
    )


# ---- return types ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [LRU, REF_ZERO])
def test_block_lists_come_back_as_int64_tensors(policy):
    state = PrefixCacheBlockState(6, policy)
    state.on_allocate(_ids(0, 1, 2), 1)
    state.stamp_block_hashes([0], [40])
    for_pool, hashes = state.on_release_compute_pool_returns(_ids(1, 2))
    assert isinstance(for_pool, torch.Tensor) and for_pool.dtype == torch.int64
    assert for_pool.tolist() == [1, 2] and isinstance(hashes, list)
    count = state.get_evictable_block_count()
    assert isinstance(count, torch.Tensor) and count.dim() == 0 and int(count) == 0
    empty, _ = state.on_release_compute_pool_returns(_ids())
    assert empty.dtype == torch.int64 and empty.numel() == 0


def test_lru_victims_are_int64_tensors():
    state = PrefixCacheBlockState(6, LRU)
    _lru_chain(state, (3, 4), 70, (1, 2))
    found = state.find_lru_evictable(2)
    assert isinstance(found, torch.Tensor) and found.dtype == torch.int64
    victims, hashes = state.try_lru_evict_for_pool(2)
    assert isinstance(victims, torch.Tensor) and victims.dtype == torch.int64
    assert victims.tolist() == found.tolist() == [4, 3] and hashes == [71, 70]


# ---- REF_ZERO release -----------------------------------------------------------------------


def test_ref_zero_release_reports_every_freed_block_hash_the_unset_ones_included():
    state = PrefixCacheBlockState(5, REF_ZERO)
    state.on_allocate(_ids(0, 1, 2, 3), 1)
    state.stamp_block_hashes([1, 3], [21, 23])
    for_pool, hashes = state.on_release_compute_pool_returns(_ids(0, 1, 2, 3))
    assert for_pool.tolist() == [0, 1, 2, 3]
    assert hashes == [UNSET_HASH, 21, UNSET_HASH, 23]  # one per freed block, in release order
    assert PrefixCacheRegistry().evict_kv(hashes) == set()  # the registry skips the -1s itself


# ---- deregister_blocks ----------------------------------------------------------------------


def test_deregister_resets_hash_references_and_timestamp_of_held_and_cached_blocks():
    state = PrefixCacheBlockState(6, LRU)
    _lru_chain(state, (0, 1), 10, (3, 4))  # cached
    state.on_allocate(_ids(2), 8)
    state.stamp_block_hashes([2], [30])  # held
    assert state.deregister_blocks(_ids(1, 2)) == [11, 30]
    assert state.block_hashes.tolist()[:3] == [10, UNSET_HASH, UNSET_HASH]
    assert state.block_ref_counts.tolist()[:3] == [0, 0, 0]
    assert state.block_timestamps.tolist()[:3] == [3, 0, 0]
    assert state.num_cached == 1 == int(state.get_evictable_block_count())
    assert state.find_lru_evictable(1).tolist() == [0]  # its child is gone: block 0 is a leaf now


def test_deregister_of_a_repeated_id_reports_the_hash_once():
    state = PrefixCacheBlockState(4, LRU)
    _lru_chain(state, (0,), 10, (1,))
    assert state.deregister_blocks([0, 0]) == [10, UNSET_HASH]
    assert state.num_cached == 0 == int(state.get_evictable_block_count())


def test_deregister_of_nothing_changes_nothing():
    state = PrefixCacheBlockState(4, LRU)
    _lru_chain(state, (0, 1), 10, (1, 2))
    before = _public(state)
    assert state.deregister_blocks(_ids()) == []
    assert _public(state) == before


# ---- get_evictable_block_count --------------------------------------------------------------


@pytest.mark.parametrize("policy", [LRU, REF_ZERO])
def test_evictable_count_follows_writes_through_the_public_tensors(policy):
    state = PrefixCacheBlockState(4, policy)
    state.on_allocate(_ids(0, 1), 1)
    state.stamp_block_hashes([0, 1], [10, 11])
    assert int(state.get_evictable_block_count()) == 0
    state.block_ref_counts[0] = 0  # a caller edits the state directly
    assert int(state.get_evictable_block_count()) == 1
    state.block_hashes[1] = 99
    state.block_ref_counts[1] = 0
    state.block_hashes[0] = UNSET_HASH
    assert int(state.get_evictable_block_count()) == 1
    assert state.num_cached == 0  # the eviction bookkeeping only follows the class's own mutations


# ---- find_lru_evictable ---------------------------------------------------------------------


def test_find_is_a_query_and_names_what_try_evicts():
    state = PrefixCacheBlockState(8, LRU)
    _lru_chain(state, (0, 1, 2), 10, (1, 2, 3))
    _lru_chain(state, (3, 4), 20, (4, 5))
    state.retain(_ids(1, 2, 0), 9)  # used again: their heap entries go stale ...
    state.on_release_compute_pool_returns(_ids(1, 2, 0))  # ... and must be re-keyed on the way
    before = _public(state)
    first = state.find_lru_evictable(4).tolist()
    assert first == [4, 3, 2, 1]  # chain B's leaf, then its root (now a leaf), then chain A's tail
    assert _public(state) == before
    assert state.find_lru_evictable(4).tolist() == first
    assert state.find_lru_evictable(6) is None  # more than are cached
    assert _public(state) == before
    victims, hashes = state.try_lru_evict_for_pool(4)
    assert victims.tolist() == first and hashes == [21, 20, 12, 11]
    assert state.find_lru_evictable(1).tolist() == [0]


def test_find_short_of_victims_answers_none_and_keeps_the_heap():
    state = PrefixCacheBlockState(4, LRU)
    state.on_allocate(_ids(0, 1), 1)
    state.stamp_block_hashes([0, 1], [10, 11])
    state.record_parent_chain([0, 1], [-1, 0])
    state.on_release_compute_pool_returns(_ids(0))  # cached, but its child is still held
    before = _public(state)
    assert state.find_lru_evictable(1) is None
    assert state.try_lru_evict_for_pool(1) is None
    assert _public(state) == before


def test_find_under_ref_zero_is_a_caller_error():
    state = PrefixCacheBlockState(4, REF_ZERO)
    with pytest.raises(AssertionError):
        state.find_lru_evictable(1)
    assert state.try_lru_evict_for_pool(1) is None


# ---- registry reset -------------------------------------------------------------------------


def test_registry_reset_fires_no_callback_and_keeps_it_installed():
    registry, freed = PrefixCacheRegistry(), []
    registry.set_mamba_evict_callback(freed.append)
    registry.register_kv([0, 1], [10, 11])
    registry.register_mamba([5, 6], [10, 11])
    registry.reset()
    assert registry.kv_hash_to_block_id == {} == registry.mamba_hash_to_block_id
    assert freed == []
    registry.register_mamba([7], [12])
    registry.evict_mamba([12])
    assert freed == [[7]]


# ---- property: find pairs with try ----------------------------------------------------------

POOL = 12
OP_KINDS = st.sampled_from(["alloc", "alloc", "match", "release", "release", "evict"])
OPS = st.lists(st.tuples(OP_KINDS, st.integers(0, 7), st.integers(0, 7)), max_size=50)


@settings(max_examples=100, deadline=None)
@given(OPS)
def test_find_then_try_agree_and_counts_match_on_random_lifecycles(ops):
    """Random owners allocate and register chains, match cached ones, release and evict."""
    state = PrefixCacheBlockState(POOL, LRU)
    free, owners, parent_of = list(range(POOL)), [], {}
    clock, next_hash = 0, 1
    for op, a, b in ops:
        clock += 1
        if op == "alloc" and free:
            blocks = [free.pop() for _ in range(min(1 + a % 3, len(free)))]
            state.on_allocate(_ids(*blocks), clock)
            registered = [x for x in range(POOL) if state.hash_of(x) != UNSET_HASH]
            parent = registered[b % len(registered)] if registered and b % 2 else -1
            state.stamp_block_hashes(blocks, list(range(next_hash, next_hash + len(blocks))))
            next_hash += len(blocks)
            state.record_parent_chain(blocks, [parent] + blocks[:-1])
            parent_of.update(zip(blocks, [parent] + blocks[:-1]))
            owners.append(blocks)
        elif op == "match":
            cached = [x for x in range(POOL) if state.hash_of(x) != UNSET_HASH and state.ref_count(x) == 0]
            if cached:
                chain, block = [], cached[a % len(cached)]
                while block >= 0:
                    chain.append(block)
                    block = parent_of[block]
                state.retain(_ids(*chain), clock)
                owners.append(chain)
        elif op == "release" and owners:
            for_pool, _ = state.on_release_compute_pool_returns(_ids(*owners.pop(a % len(owners))))
            free.extend(for_pool.tolist())
        elif op == "evict":
            before = _public(state)
            found = state.find_lru_evictable(1 + a % 4)
            assert _public(state) == before
            again = state.find_lru_evictable(1 + a % 4)
            assert (found is None) == (again is None)
            evicted = state.try_lru_evict_for_pool(1 + a % 4)
            event("evicted" if evicted else "too few evictable")
            if found is None:
                assert evicted is None and _public(state) == before
            else:
                assert found.tolist() == again.tolist() == evicted[0].tolist()
                assert all(h != UNSET_HASH for h in evicted[1])
                free.extend(evicted[0].tolist())
                for victim in evicted[0].tolist():
                    parent_of.pop(victim, None)
        assert state.num_cached == int(state.get_evictable_block_count())
        unhashed_idle = [x for x in range(POOL) if state.hash_of(x) == UNSET_HASH and state.ref_count(x) == 0]
        assert sorted(free) == unhashed_idle  # every chain was registered: only freed blocks lack a hash
