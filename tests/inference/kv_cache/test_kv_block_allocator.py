"""`KVBlockAllocator`: overflow, release batches, registration rules, reset, LRU order, events."""

import pytest

from inference.errors import BlockOverflowError
from inference.kv_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EvictionPolicy,
    KVBlockAllocator,
    KVEventHub,
    block_hashes,
)
from inference.kv_cache.allocator import BlockRun
from inference.kv_cache.block_key import BlockKey
from inference.kv_cache.block_state import PromptLogprobsBlock
from inference.kv_cache.hashing import UNSET_HASH

LRU, REF_ZERO = EvictionPolicy.LRU, EvictionPolicy.REF_ZERO
BOTH = pytest.mark.parametrize("policy", [LRU, REF_ZERO])
BS = 2


def _snapshot(alloc):
    """Everything observable about an allocator, for "changes nothing" checks."""
    state = alloc.state
    return (
        state.block_ref_counts.tolist(),
        state.block_hashes.tolist(),
        None if state.block_timestamps is None else state.block_timestamps.tolist(),
        dict(alloc.registry.kv_hash_to_block_id),
        alloc.free_block_ids(),
        alloc.stats(),
        alloc.available,
        alloc.lru_clock,
    )


def _request(alloc, tokens, extra_key=None):
    """Match, allocate the rest, register the full blocks: what an engine does for a prompt."""
    hashes = block_hashes(tokens, BS, extra_key=extra_key)
    matched = alloc.match_prefix(hashes)
    blocks = matched + alloc.allocate(-(-len(tokens) // BS) - len(matched))
    parent = matched[-1] if matched else -1
    alloc.register(blocks[len(matched) : len(hashes)], hashes[len(matched) :], parent)
    return blocks


# ---- allocation -----------------------------------------------------------------------------


def test_fresh_pool():
    alloc = KVBlockAllocator(4, BS)
    assert alloc.stats().total == 4 and alloc.free == 4 and alloc.active == 0 and alloc.cached == 0
    assert alloc.allocate(0) == []
    assert alloc.lru_clock == 0
    assert sorted(alloc.allocate(4)) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        alloc.allocate(-1)
    for bad in (dict(num_blocks=0, block_size=2), dict(num_blocks=2, block_size=0)):
        with pytest.raises(ValueError):
            KVBlockAllocator(**bad)


@BOTH
def test_allocate_beyond_capacity_raises_and_changes_nothing(policy):
    alloc = KVBlockAllocator(6, BS, policy)
    held = _request(alloc, [1, 2, 3, 4, 5])  # 3 blocks, 2 registered, held
    cached = _request(alloc, [7, 7, 8, 8])
    alloc.release(cached)  # LRU: 2 cached; REF_ZERO: 2 free
    before = _snapshot(alloc)
    with pytest.raises(BlockOverflowError) as info:
        alloc.allocate(4)
    assert info.value.is_transient  # fits once the held request finishes
    assert _snapshot(alloc) == before
    with pytest.raises(BlockOverflowError) as info:
        alloc.allocate(7)
    assert not info.value.is_transient  # can never fit
    assert _snapshot(alloc) == before
    alloc.release(held)
    assert len(alloc.allocate(6)) == 6


def test_allocate_under_pressure_evicts_lru_and_drops_the_hashes():
    alloc = KVBlockAllocator(4, BS, LRU)
    alloc.release(_request(alloc, [1, 1, 2, 2]))
    assert alloc.cached == 2 and alloc.free == 2
    got = alloc.allocate(3)
    assert len(set(got)) == 3
    assert alloc.cached == 1 and alloc.peek_prefix(block_hashes([1, 1, 2, 2], BS)) == (1, 1)


# ---- release / retain -----------------------------------------------------------------------


@BOTH
def test_duplicate_ids_in_a_release_batch_drop_one_ref_each_and_return_once(policy):
    alloc = KVBlockAllocator(4, BS, policy)
    a = _request(alloc, [1, 2, 3])  # block 0 registered, block 1 partial
    b = alloc.match_prefix(block_hashes([1, 2], BS))
    assert b == a[:1] and alloc.state.ref_count(a[0]) == 2
    alloc.release(a + b)  # two owners finishing in one batch
    free = alloc.free_block_ids()
    assert len(free) == len(set(free))
    assert alloc.state.block_ref_counts.tolist() == [0] * 4
    if policy is REF_ZERO:
        assert sorted(free) == [0, 1, 2, 3] and alloc.registry.kv_hash_to_block_id == {}
    else:
        assert alloc.cached == 1 and alloc.free == 3


@BOTH
def test_releasing_a_block_more_often_than_held_is_refused(policy):
    alloc = KVBlockAllocator(4, BS, policy)
    blocks = _request(alloc, [1, 2])
    before = _snapshot(alloc)
    with pytest.raises(ValueError):
        alloc.release(blocks + blocks)
    assert _snapshot(alloc) == before


def test_a_refused_release_leaves_the_cache_evictable():
    alloc = KVBlockAllocator(2, BS, LRU)
    blocks = _request(alloc, [1, 2])
    alloc.release(blocks)
    before = _snapshot(alloc)
    with pytest.raises(ValueError):
        alloc.release(blocks)  # already released
    assert _snapshot(alloc) == before
    assert len(alloc.allocate(2)) == 2  # available says 2


@BOTH
def test_release_of_an_unheld_block_is_refused(policy):
    alloc = KVBlockAllocator(4, BS, policy)
    with pytest.raises(ValueError):
        alloc.release([2])
    alloc.release([])
    assert alloc.free == 4


@BOTH
def test_retain_adds_owners_and_refuses_unallocated_blocks(policy):
    alloc = KVBlockAllocator(4, BS, policy)
    blocks = _request(alloc, [1, 2, 3, 4])
    alloc.retain(blocks)  # a forked sample
    assert [alloc.state.ref_count(b) for b in blocks] == [2, 2]
    with pytest.raises(ValueError):
        alloc.retain([3])
    alloc.release(blocks)
    alloc.release(blocks)
    assert alloc.active == 0
    with pytest.raises(ValueError):
        alloc.retain(blocks)  # cached (LRU) or free (REF_ZERO): nobody holds them


# ---- match / register -----------------------------------------------------------------------


@BOTH
def test_match_prefix_retains_and_counts_hits(policy):
    alloc = KVBlockAllocator(8, BS, policy)
    first = _request(alloc, [1, 2, 3, 4, 5, 6])
    hashes = block_hashes([1, 2, 3, 4, 9, 9], BS)
    assert alloc.peek_prefix(hashes) == (2, 0)  # both held by `first`
    assert alloc.match_prefix(hashes) == first[:2]
    assert [alloc.state.ref_count(b) for b in first] == [2, 2, 1]
    assert (alloc.stats().hit_blocks, alloc.stats().miss_blocks) == (2, 4)
    assert alloc.stats().hit_rate == pytest.approx(2 / 6)
    assert alloc.match_prefix([]) == []
    assert alloc.peek_prefix(block_hashes([1, 2], BS, extra_key="other")) == (0, 0)
    assert alloc.peek_prefix([]) == (0, 0)


def test_peek_prefix_counts_matched_blocks_nobody_holds():
    alloc = KVBlockAllocator(8, BS, LRU)
    tokens = [1, 2, 3, 4, 5, 6]
    blocks = _request(alloc, tokens)
    alloc.release(blocks)
    held = alloc.match_prefix(block_hashes(tokens[:2], BS))
    before = _snapshot(alloc)
    assert alloc.peek_prefix(block_hashes(tokens, BS)) == (3, 2)
    assert _snapshot(alloc) == before  # changes nothing
    alloc.release(held)
    assert alloc.peek_prefix(block_hashes(tokens, BS)) == (3, 3)


def test_prefix_caching_disabled():
    alloc = KVBlockAllocator(4, BS, enable_prefix_caching=False)
    blocks = alloc.allocate(1)
    assert alloc.register(blocks, block_hashes([1, 2], BS)) == 0
    assert alloc.match_prefix(block_hashes([1, 2], BS)) == []
    assert alloc.peek_prefix(block_hashes([1, 2], BS)) == (0, 0)
    assert alloc.registry.kv_hash_to_block_id == {}


@BOTH
def test_register_refuses_an_unregistered_parent(policy):
    alloc = KVBlockAllocator(4, BS, policy)
    parent, child = alloc.allocate(2)
    hashes = block_hashes([1, 2, 3, 4], BS)
    assert alloc.register([child], hashes[1:], parent_block_id=parent) == 0
    assert alloc.registry.kv_hash_to_block_id == {}
    assert alloc.state.hash_of(child) == UNSET_HASH
    assert alloc.register([parent, child], hashes) == 2


@BOTH
def test_register_stops_at_a_hash_served_by_another_block(policy):
    """Two requests computed the same prefix concurrently: the second copy stays private."""
    alloc = KVBlockAllocator(8, BS, policy)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = block_hashes(tokens, BS)
    first = alloc.allocate(3)
    second = alloc.allocate(3)
    assert alloc.register(first[:2], hashes[:2]) == 2
    assert alloc.register(second, hashes) == 0  # hash[0] already served
    assert alloc.register(first[2:], hashes[2:], first[1]) == 1
    assert alloc.register(second[2:], hashes[2:], second[1]) == 0  # its parent is private
    assert alloc.registry.kv_hash_to_block_id == dict(zip(hashes, first))
    alloc.release(second)
    assert all(b in alloc.free_block_ids() for b in second)
    assert alloc.match_prefix(hashes) == first


@BOTH
def test_register_stops_midway_and_skips_registered_or_unheld_blocks(policy):
    alloc = KVBlockAllocator(8, BS, policy)
    hashes = block_hashes([1, 2, 3, 4, 5, 6], BS)
    blocks = alloc.allocate(3)
    other = block_hashes([9, 9], BS)
    assert alloc.register(blocks[1:2], other) == 1  # block 1 now holds another hash
    assert alloc.register(blocks, hashes) == 1  # stops at block 1: registered before
    assert alloc.registry.kv_hash_to_block_id == {hashes[0]: blocks[0], other[0]: blocks[1]}
    assert alloc.register([7], block_hashes([8, 8], BS)) == 0  # free block: nobody holds it
    with pytest.raises(ValueError):
        alloc.register(blocks, hashes[:2])


@BOTH
def test_register_with_an_invalid_hash_changes_nothing(policy):
    alloc = KVBlockAllocator(4, BS, policy)
    blocks = alloc.allocate(2)
    before = _snapshot(alloc)
    with pytest.raises(ValueError):
        alloc.register(blocks, [block_hashes([1, 2], BS)[0], 0])
    assert _snapshot(alloc) == before


@BOTH
def test_register_runs_registers_each_run_in_turn_and_stops_after_a_short_one(policy):
    """One call for a step's runs leaves what registering them one by one leaves (hashes, keys,
    versions, scores, LRU chains, events), a run seeing the runs before it; it stops after the
    first run registered short so the caller can act before the rest go."""

    scores = PromptLogprobsBlock(BS, 0)
    salted = BlockKey(3, "tenant")
    a, b = block_hashes([1, 2, 3, 4], BS), block_hashes([5, 6], BS, extra_key=salted.hash_key())

    def runs(blocks):
        return [BlockRun(blocks[0:2], a, -1), BlockRun(blocks[2:3], b, -1, salted, [scores]),
                BlockRun(blocks[3:5], [a[1], 77], blocks[2]),  # its first hash: served by run 0's
                BlockRun(blocks[5:6], [88], -1)]

    one_by_one = KVBlockAllocator(16, BS, policy, events=KVEventHub(record=True))
    batched = KVBlockAllocator(16, BS, policy, events=KVEventHub(record=True))
    counts = [one_by_one.register(r.block_ids, r.hashes, r.parent_block_id, prompt_logprobs=r.prompt_logprobs,
                                  key=r.key, computed_by=5) for r in runs(one_by_one.allocate(8))[:3]]
    assert batched.register_runs(runs(batched.allocate(8)), computed_by=5) == counts == [2, 1, 0]
    assert _snapshot(batched) == _snapshot(one_by_one)
    for alloc in (one_by_one, batched):
        alloc.events.publish_pending()
    assert batched.events.take_events() == one_by_one.events.take_events()
    for block in range(8):
        for look in ("key_of", "computed_by"):
            assert getattr(batched.state, look)(block) == getattr(one_by_one.state, look)(block)
        assert batched.prompt_logprobs_of(block) is one_by_one.prompt_logprobs_of(block)
    assert batched.prompt_logprobs_of(2) is scores and batched.state.key_of(2) == salted
    evicted = {}
    for alloc in (one_by_one, batched):  # NOTE: under LRU the parent chains decide the order (leaves first)
        alloc.release(list(range(8)))
        alloc.allocate(alloc.free)
        evicted[alloc] = []
        while alloc.registry.kv_hash_to_block_id:
            alloc.allocate(1)
            evicted[alloc].append(dict(alloc.registry.kv_hash_to_block_id))
    assert evicted[batched] == evicted[one_by_one]


@BOTH
def test_register_runs_of_uneven_lengths_chain_each_block_to_its_own_parent(policy):
    """An empty run beside a two-block one (as many blocks as runs): each block keeps its own
    parent and key, as registering the runs one by one gives."""

    one_by_one, batched = KVBlockAllocator(8, BS, policy), KVBlockAllocator(8, BS, policy)
    keyed = BlockKey(2)

    def runs(blocks):
        return [BlockRun([], [], -1), BlockRun(blocks[:2], block_hashes([1, 2, 3, 4], BS, extra_key=2), -1, keyed)]

    for r in runs(one_by_one.allocate(2)):
        one_by_one.register(r.block_ids, r.hashes, r.parent_block_id, key=r.key)
    assert batched.register_runs(runs(batched.allocate(2))) == [0, 2]
    assert _snapshot(batched) == _snapshot(one_by_one)
    assert [batched.state.key_of(b) for b in (0, 1)] == [keyed, keyed]
    for alloc in (one_by_one, batched):
        alloc.release([0, 1])
    if policy is LRU:  # NOTE: block 1's parent is block 0: the leaf goes first
        assert batched.allocate(7)[-1] == one_by_one.allocate(7)[-1]
        assert dict(batched.registry.kv_hash_to_block_id) == dict(one_by_one.registry.kv_hash_to_block_id)
        assert list(batched.registry.kv_hash_to_block_id.values()) == [0]


@BOTH
def test_register_runs_with_a_malformed_run_changes_nothing(policy):

    alloc = KVBlockAllocator(8, BS, policy)
    blocks = alloc.allocate(3)
    before = _snapshot(alloc)
    with pytest.raises(ValueError):
        alloc.register_runs([BlockRun(blocks[:1], [11]), BlockRun(blocks[1:3], [12])])
    with pytest.raises(ValueError):
        alloc.register_runs([BlockRun(blocks[:1], [11]), BlockRun(blocks[1:2], [-1])])
    assert _snapshot(alloc) == before


# ---- reset_prefix_cache / reset -------------------------------------------------------------


@BOTH
def test_reset_prefix_cache_while_requests_hold_blocks(policy):
    alloc = KVBlockAllocator(8, BS, policy)
    cached_tokens, held_tokens = [5, 5, 6, 6], [1, 2, 3, 4, 5]
    alloc.release(_request(alloc, cached_tokens))
    held = _request(alloc, held_tokens)
    refs_before = alloc.state.block_ref_counts.tolist()
    alloc.reset_prefix_cache()
    assert alloc.state.block_ref_counts.tolist() == refs_before  # held blocks stay held
    assert all(alloc.state.hash_of(b) == UNSET_HASH for b in held)  # ... and unregistered
    assert alloc.registry.kv_hash_to_block_id == {}
    assert alloc.cached == 0 and alloc.free == 8 - len(held)  # cached ones went to the pool
    for tokens in (cached_tokens, held_tokens):
        assert alloc.peek_prefix(block_hashes(tokens, BS)) == (0, 0)
        assert alloc.match_prefix(block_hashes(tokens, BS)) == []
    # The held request may not extend its old chain: its parent is no longer registered.
    assert alloc.register(held[2:], block_hashes(held_tokens + [6], BS)[2:], held[1]) == 0
    alloc.release(held)  # a release afterwards returns the held blocks to the free pool
    assert set(held) <= set(alloc.free_block_ids())
    assert alloc.active == 0 and alloc.free == 8 and alloc.cached == 0


@BOTH
def test_reset_forgets_everything(policy):
    alloc = KVBlockAllocator(4, BS, policy)
    _request(alloc, [1, 2, 3, 4])
    alloc.reset()
    assert sorted(alloc.free_block_ids()) == [0, 1, 2, 3]
    assert alloc.state.block_ref_counts.tolist() == [0] * 4
    assert alloc.peek_prefix(block_hashes([1, 2, 3, 4], BS)) == (0, 0)


# ---- LRU order ------------------------------------------------------------------------------


def _fill_to_force_evictions(alloc, n):
    """Allocate all free blocks plus `n` more; return the hashes left in the registry."""
    alloc.allocate(alloc.free + n)
    return set(alloc.registry.kv_hash_to_block_id)


def test_lru_evicts_the_leaf_before_its_root_even_on_a_timestamp_tie():
    alloc = KVBlockAllocator(4, BS, LRU)
    root, leaf = _request(alloc, [1, 2, 3, 4])  # a fresh pool hands out root=0, leaf=1
    assert (root, leaf) == (0, 1)
    alloc.release([root, leaf])  # equal timestamps: oldest-first-by-id would pick the root
    hashes = block_hashes([1, 2, 3, 4], BS)
    assert _fill_to_force_evictions(alloc, 1) == {hashes[0]}
    assert alloc.peek_prefix(hashes) == (1, 1)


def test_lru_evicts_the_least_recently_used_chain_first_and_matching_refreshes():
    alloc = KVBlockAllocator(6, BS, LRU)
    old, young = [1, 1, 2, 2], [3, 3, 4, 4]
    alloc.release(_request(alloc, old))
    alloc.release(_request(alloc, young))
    alloc.release(alloc.match_prefix(block_hashes(old, BS)))  # reuse makes `old` the newest
    left = _fill_to_force_evictions(alloc, 2)
    assert left == set(block_hashes(old, BS))


def test_lru_keeps_a_shared_root_while_a_branch_is_evicted():
    alloc = KVBlockAllocator(8, BS, LRU)
    alloc.release(_request(alloc, [1, 1, 2, 2]))
    alloc.release(_request(alloc, [1, 1, 3, 3]))  # shares the root, younger branch
    root, branch_a = block_hashes([1, 1, 2, 2], BS)
    _, branch_b = block_hashes([1, 1, 3, 3], BS)
    assert _fill_to_force_evictions(alloc, 1) == {root, branch_b}
    alloc.release(alloc.match_prefix([root]))
    assert alloc.cached == 2


# ---- events ---------------------------------------------------------------------------------


def _with_events(policy, num_blocks=4):
    hub = KVEventHub(record=True)
    return KVBlockAllocator(num_blocks, BS, policy, events=hub), hub


@BOTH
def test_stored_events_wait_for_publish(policy):
    alloc, hub = _with_events(policy)
    blocks = _request(alloc, [1, 2, 3, 4])
    hashes = block_hashes([1, 2, 3, 4], BS)
    assert hub.take_events() == []
    hub.publish_pending()
    assert hub.take_events() == [BlockStored(tuple(hashes), 0, tuple(blocks), BS)]
    assert hub.take_events() == []
    more = alloc.allocate(1)
    alloc.register(more, block_hashes([1, 2, 3, 4, 5, 6], BS)[2:], blocks[1])
    hub.publish_pending()
    (event,) = hub.take_events()
    assert event.parent_block_hash == hashes[1] and event.block_ids == tuple(more)


@BOTH
def test_discarded_stored_events_are_never_published(policy):
    alloc, hub = _with_events(policy)
    _request(alloc, [1, 2])
    hub.discard_pending()
    hub.publish_pending()
    assert hub.take_events() == []


def test_removed_events_after_lru_eviction():
    alloc, hub = _with_events(LRU)
    alloc.release(_request(alloc, [1, 2, 3, 4]))
    hub.publish_pending()
    hub.take_events()
    alloc.allocate(3)
    assert hub.take_events() == [BlockRemoved((block_hashes([1, 2, 3, 4], BS)[1],))]


def test_removed_events_after_ref_zero_release():
    alloc, hub = _with_events(REF_ZERO)
    blocks = _request(alloc, [1, 2, 3, 4])
    hub.publish_pending()
    hub.take_events()
    alloc.release(blocks)
    assert hub.take_events() == [BlockRemoved(tuple(sorted(block_hashes([1, 2, 3, 4], BS))))]


def test_removing_a_still_pending_block_announces_nothing():
    alloc, hub = _with_events(REF_ZERO)
    alloc.release(_request(alloc, [1, 2]))
    hub.publish_pending()
    assert hub.take_events() == []


@BOTH
def test_reset_prefix_cache_and_reset_announce_all_cleared(policy):
    alloc, hub = _with_events(policy)
    _request(alloc, [1, 2])
    alloc.reset_prefix_cache()
    hub.publish_pending()  # the pending stored event was cleared too
    assert hub.take_events() == [AllBlocksCleared()]
    alloc.reset()
    assert hub.take_events() == [AllBlocksCleared()]


def test_a_disabled_hub_costs_nothing_and_records_nothing():
    alloc = KVBlockAllocator(4, BS)
    alloc.release(_request(alloc, [1, 2]))
    alloc.events.publish_pending()
    assert alloc.events.take_events() == []
