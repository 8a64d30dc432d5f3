"""`PrefixCacheBlockState`: each seed method's documented edge cases, under both policies."""

import numpy as np
import pytest
import torch

from inference.kv_cache.block_state import (
    MAX_CACHED_PROMPT_TOP_N_LOGPROBS,
    PrefixCacheBlockState,
    PromptLogprobsBlock,
)
from inference.kv_cache.hashing import UNSET_HASH
from inference.kv_cache.policy import EvictionPolicy

LRU, REF_ZERO = EvictionPolicy.LRU, EvictionPolicy.REF_ZERO


def _cached_chain(state, block_ids, hashes, clocks):
    """Allocate `block_ids` at `clocks`, register them as one chain, release them all."""
    for block_id, clock in zip(block_ids, clocks):
        state.on_allocate([block_id], clock)
    assert state.stamp_block_hashes(block_ids, hashes) == list(range(len(block_ids)))
    state.record_parent_chain(block_ids, [-1] + list(block_ids[:-1]))
    return state.on_release_compute_pool_returns(block_ids)


def _snapshot(state):
    return (
        state.block_hashes.tolist(),
        state.block_ref_counts.tolist(),
        None if state.block_timestamps is None else state.block_timestamps.tolist(),
        int(state.get_evictable_block_count()),
    )


def _as_lists(result):
    """A (block id tensor, hash list) result as two lists, for comparison."""
    blocks, hashes = result
    return blocks.tolist(), hashes


# ---- construction, reset --------------------------------------------------------------------


def test_fresh_state():
    for policy in (LRU, REF_ZERO):
        state = PrefixCacheBlockState(4, policy)
        assert state.block_hashes.tolist() == [UNSET_HASH] * 4
        assert state.block_ref_counts.tolist() == [0] * 4
        assert state.is_lru is (policy is LRU)
        assert (state.block_timestamps is None) is (policy is REF_ZERO)
    assert PrefixCacheBlockState(2, "lru").is_lru
    with pytest.raises(ValueError):
        PrefixCacheBlockState(0, LRU)


@pytest.mark.parametrize("policy", [LRU, REF_ZERO])
def test_reset_forgets_everything(policy):
    state = PrefixCacheBlockState(4, policy)
    state.on_allocate([0, 1], 3)
    state.stamp_block_hashes([0, 1], [11, 12])
    state.record_parent_chain([0, 1], [-1, 0])
    state.prompt_logprobs[0] = PromptLogprobsBlock(2, 1)
    state.on_release_compute_pool_returns([1])
    state.reset()
    assert state.block_hashes.tolist() == [UNSET_HASH] * 4
    assert state.block_ref_counts.tolist() == [0] * 4
    assert state.prompt_logprobs == {}
    assert state.get_evictable_block_count() == 0
    if policy is LRU:
        assert state.find_lru_evictable(1) is None
        assert state.block_timestamps.tolist() == [0] * 4


# ---- stamp_block_hashes / record_parent_chain -----------------------------------------------


def test_stamp_returns_positions_newly_stamped_in_input_order():
    state = PrefixCacheBlockState(6, LRU)
    state.stamp_block_hashes([2], [22])
    assert state.stamp_block_hashes([3, 2, 4, 5], [33, 99, UNSET_HASH, 55]) == [0, 3]
    assert state.block_hashes.tolist() == [UNSET_HASH, UNSET_HASH, 22, 33, UNSET_HASH, 55]
    assert state.stamp_block_hashes(torch.tensor([0]), [0]) == []  # 0 is not a hash
    with pytest.raises(ValueError):
        state.stamp_block_hashes([0, 1], [1])


def test_record_parent_chain_makes_a_parent_a_leaf_only_after_its_last_child():
    state = PrefixCacheBlockState(4, LRU)
    state.on_allocate([0, 1, 2], 1)
    state.stamp_block_hashes([0, 1, 2], [10, 11, 12])
    state.record_parent_chain([0], [-1])
    state.record_parent_chain([1, 2], [0, 0])  # two children of block 0
    state.on_release_compute_pool_returns([0, 1, 2])
    assert state.get_evictable_block_count() == 3
    victims = state.try_lru_evict_for_pool(3)[0].tolist()
    assert sorted(victims[:2]) == [1, 2] and victims[2] == 0


def test_record_parent_chain_is_a_no_op_under_ref_zero():
    state = PrefixCacheBlockState(4, REF_ZERO)
    state.record_parent_chain([1, 2], [-1, 1])
    state.record_parent_chain(np.array([3]), np.array([2]))
    assert not hasattr(state, "_child_counts")


# ---- update_timestamps / on_allocate / retain -----------------------------------------------


def test_update_timestamps_and_on_allocate():
    state = PrefixCacheBlockState(4, LRU)
    state.on_allocate(torch.tensor([1, 2]), 5)
    assert state.block_ref_counts.tolist() == [0, 1, 1, 0]
    assert state.block_timestamps.tolist() == [0, 5, 5, 0]
    state.update_timestamps([2], 9)
    assert state.block_timestamps.tolist() == [0, 5, 9, 0]
    ref_zero = PrefixCacheBlockState(4, REF_ZERO)
    ref_zero.on_allocate([1], 5)
    ref_zero.update_timestamps([1], 9)  # no-op, no error
    assert ref_zero.block_ref_counts.tolist() == [0, 1, 0, 0]


def test_retain_adds_one_reference_per_occurrence_and_refreshes():
    state = PrefixCacheBlockState(4, LRU)
    state.on_allocate([0, 1], 1)
    state.retain([0, 0, 1], 4)
    assert state.block_ref_counts.tolist() == [3, 2, 0, 0]
    assert state.block_timestamps.tolist() == [4, 4, 0, 0]


def test_retaining_a_cached_block_takes_it_out_of_the_reservoir():
    state = PrefixCacheBlockState(4, LRU)
    _cached_chain(state, [0, 1], [10, 11], [1, 1])
    assert state.get_evictable_block_count() == 2
    state.retain([0, 1], 5)  # a matched prefix
    assert state.get_evictable_block_count() == 0
    assert state.find_lru_evictable(1) is None
    assert _as_lists(state.on_release_compute_pool_returns([0, 1])) == ([], [])
    assert state.get_evictable_block_count() == 2
    assert state.find_lru_evictable(2).tolist() == [1, 0]


# ---- counts ---------------------------------------------------------------------------------


def test_evictable_and_extra_blocks_available():
    lru = PrefixCacheBlockState(4, LRU)
    _cached_chain(lru, [0, 1], [10, 11], [1, 1])
    assert lru.get_evictable_block_count() == 2 == lru.extra_blocks_available()
    ref_zero = PrefixCacheBlockState(4, REF_ZERO)
    _cached_chain(ref_zero, [0, 1], [10, 11], [1, 1])
    assert ref_zero.get_evictable_block_count() == 0 == ref_zero.extra_blocks_available()


# ---- on_release_compute_pool_returns --------------------------------------------------------


@pytest.mark.parametrize("policy", [LRU, REF_ZERO])
def test_duplicate_ids_drop_one_ref_each_but_return_a_block_once(policy):
    state = PrefixCacheBlockState(4, policy)
    state.on_allocate([0, 1], 1)
    state.retain([0, 1], 2)  # two owners each
    for_pool, hashes = _as_lists(state.on_release_compute_pool_returns([0, 1, 0, 1, 0][:4]))
    assert sorted(for_pool) == [0, 1] and len(for_pool) == 2
    assert hashes == ([UNSET_HASH, UNSET_HASH] if policy is REF_ZERO else [])  # REF_ZERO: one per freed block
    assert state.block_ref_counts.tolist() == [0, 0, 0, 0]


def test_duplicate_ids_of_a_still_held_block_return_nothing():
    state = PrefixCacheBlockState(2, REF_ZERO)
    state.on_allocate([0], 1)
    state.retain([0, 0], 1)
    assert _as_lists(state.on_release_compute_pool_returns([0, 0])) == ([], [])
    assert state.ref_count(0) == 1


def test_ref_zero_release_deregisters_and_returns_hashes():
    state = PrefixCacheBlockState(4, REF_ZERO)
    state.on_allocate([0, 1, 2], 1)
    state.stamp_block_hashes([0, 1], [10, 11])
    state.retain([0], 2)
    for_pool, hashes = state.on_release_compute_pool_returns([0, 1, 2])
    assert for_pool.tolist() == [1, 2]
    assert hashes == [11, UNSET_HASH]  # as the seed says: the hash of each freed block, -1 if it had none
    assert state.block_hashes.tolist() == [10, UNSET_HASH, UNSET_HASH, UNSET_HASH]


def test_lru_release_keeps_registered_blocks_cached():
    state = PrefixCacheBlockState(4, LRU)
    state.on_allocate([0, 1], 1)
    state.stamp_block_hashes([0], [10])
    assert _as_lists(state.on_release_compute_pool_returns([0, 1])) == ([1], [])
    assert state.block_hashes.tolist()[0] == 10
    assert state.get_evictable_block_count() == 1


@pytest.mark.parametrize("policy", [LRU, REF_ZERO])
def test_release_of_an_unheld_block_is_refused_and_changes_nothing(policy):
    state = PrefixCacheBlockState(4, policy)
    state.on_allocate([0], 1)
    before = _snapshot(state)
    with pytest.raises(ValueError):
        state.on_release_compute_pool_returns([0, 3])
    assert _snapshot(state) == before


@pytest.mark.parametrize("policy", [LRU, REF_ZERO])
def test_releasing_more_references_than_held_is_refused(policy):
    state = PrefixCacheBlockState(4, policy)
    state.on_allocate([0], 1)
    state.stamp_block_hashes([0], [10])
    before = _snapshot(state)
    with pytest.raises(ValueError):
        state.on_release_compute_pool_returns([0, 0])
    assert _snapshot(state) == before


# ---- LRU eviction ---------------------------------------------------------------------------


def test_try_lru_evict_for_pool_is_none_and_find_lru_evictable_a_caller_bug_under_ref_zero():
    state = PrefixCacheBlockState(4, REF_ZERO)
    assert state.try_lru_evict_for_pool(1) is None
    with pytest.raises(AssertionError):
        state.find_lru_evictable(0)


def test_try_lru_evict_returns_exactly_the_needed_victims_and_their_hashes():
    state = PrefixCacheBlockState(6, LRU)
    _cached_chain(state, [0, 1, 2], [10, 11, 12], [1, 2, 3])
    assert state.try_lru_evict_for_pool(4) is None  # fewer evictable: nothing changes
    assert state.get_evictable_block_count() == 3
    assert state.find_lru_evictable(0).tolist() == []
    victims, hashes = _as_lists(state.try_lru_evict_for_pool(2))
    assert victims == [2, 1] and hashes == [12, 11]
    assert state.block_hashes.tolist()[:3] == [10, UNSET_HASH, UNSET_HASH]
    assert state.get_evictable_block_count() == 1
    assert _as_lists(state.try_lru_evict_for_pool(1)) == ([0], [10])
    assert state.get_evictable_block_count() == 0


def test_younger_leaf_goes_before_its_older_root():
    """Chunked prefill: the root was allocated first (older) yet must outlive its younger leaf."""
    state = PrefixCacheBlockState(4, LRU)
    _cached_chain(state, [0, 1], [10, 11], [1, 7])  # root at clock 1, leaf at clock 7
    state.on_allocate([2], 4)  # an unrelated, middle-aged cached leaf
    state.stamp_block_hashes([2], [20])
    state.record_parent_chain([2], [-1])
    state.on_release_compute_pool_returns([2])
    victims = state.try_lru_evict_for_pool(3)[0].tolist()
    assert victims == [2, 1, 0]  # root only after its leaf, although it is the oldest


def test_evicting_a_leaf_turns_its_parent_into_a_candidate_keyed_by_its_own_age():
    state = PrefixCacheBlockState(6, LRU)
    _cached_chain(state, [0, 1], [10, 11], [1, 2])  # chain A: old root, old leaf
    _cached_chain(state, [2, 3], [20, 21], [5, 6])  # chain B: young
    victims = state.try_lru_evict_for_pool(3)[0].tolist()
    assert victims == [1, 0, 3]


def test_a_cached_parent_of_a_held_child_is_not_evictable():
    state = PrefixCacheBlockState(4, LRU)
    state.on_allocate([0, 1], 1)
    state.stamp_block_hashes([0, 1], [10, 11])
    state.record_parent_chain([0, 1], [-1, 0])
    state.on_release_compute_pool_returns([0])  # parent at zero refs, child still held
    assert state.get_evictable_block_count() == 1
    assert state.find_lru_evictable(1) is None
    assert state.try_lru_evict_for_pool(1) is None
    state.on_release_compute_pool_returns([1])
    assert state.try_lru_evict_for_pool(2)[0].tolist() == [1, 0]


def test_find_lru_evictable_hands_victims_to_the_caller_to_deregister():
    # the seed's contract: find picks the victims, the caller deregisters them (see try_lru_evict_for_pool)
    state = PrefixCacheBlockState(4, LRU)
    _cached_chain(state, [0, 1], [10, 11], [1, 2])
    victims = state.find_lru_evictable(2)
    assert victims.tolist() == [1, 0]
    assert state.deregister_blocks(victims) == [11, 10]
    assert state.get_evictable_block_count() == 0
    assert state.find_lru_evictable(1) is None


# ---- deregister_blocks / detach_all ---------------------------------------------------------


@pytest.mark.parametrize("policy", [LRU, REF_ZERO])
def test_deregister_returns_hashes_and_resets_block_state(policy):
    state = PrefixCacheBlockState(4, policy)
    state.on_allocate([0, 1], 1)
    state.stamp_block_hashes([0], [10])
    state.prompt_logprobs[0] = PromptLogprobsBlock(2, 1)
    assert state.deregister_blocks([0, 1]) == [10, UNSET_HASH]
    assert state.block_hashes.tolist()[:2] == [UNSET_HASH, UNSET_HASH]
    assert state.block_ref_counts.tolist()[:2] == [0, 0]  # the seed: hash, ref count, timestamp
    if policy is LRU:
        assert state.block_timestamps.tolist()[:2] == [0, 0]
    assert state.prompt_logprobs == {}


def test_detach_all_returns_the_cached_blocks_and_keeps_held_ones():
    state = PrefixCacheBlockState(4, LRU)
    _cached_chain(state, [0, 1], [10, 11], [1, 1])
    state.on_allocate([2], 3)
    state.stamp_block_hashes([2], [20])
    assert sorted(state.detach_all()) == [0, 1]
    assert state.block_hashes.tolist() == [UNSET_HASH] * 4
    assert state.block_ref_counts.tolist() == [0, 0, 1, 0]
    assert state.get_evictable_block_count() == 0
    assert _as_lists(state.on_release_compute_pool_returns([2])) == ([2], [])


# ---- PromptLogprobsBlock --------------------------------------------------------------------


def test_prompt_logprobs_block_shapes_and_bounds():
    block = PromptLogprobsBlock(4, 3)
    assert block.log_probs.shape == (4,)
    assert block.top_n_log_probs.shape == (4, 3)
    assert block.top_n_token_ids.shape == (4, 3) and block.top_n_token_ids.dtype == torch.int64
    assert block.valid.tolist() == [False] * 4
    assert block.next_token_id == -1
    PromptLogprobsBlock(4, 0)
    PromptLogprobsBlock(4, MAX_CACHED_PROMPT_TOP_N_LOGPROBS)
    for bad in (-1, MAX_CACHED_PROMPT_TOP_N_LOGPROBS + 1):
        with pytest.raises(ValueError):
            PromptLogprobsBlock(4, bad)
    with pytest.raises(AttributeError):
        block.other = 1  # __slots__
