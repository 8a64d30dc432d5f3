"""`PrefixCacheRegistry`: the seed's match / register / evict primitives and their edge cases."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.kv_cache.hashing import NO_PARENT, UNSET_HASH
from inference.kv_cache.registry import PrefixCacheRegistry


def _with_mamba_log():
    registry = PrefixCacheRegistry()
    calls: list[list[int]] = []
    registry.set_mamba_evict_callback(calls.append)
    return registry, calls


# ---- match_kv_prefix ------------------------------------------------------------------------


def test_match_on_empty_registry_or_empty_query():
    registry = PrefixCacheRegistry()
    assert registry.match_kv_prefix([]) == ([], NO_PARENT)
    assert registry.match_kv_prefix([11, 12]) == ([], NO_PARENT)
    registry.register_kv([0], [11])
    assert registry.match_kv_prefix([]) == ([], NO_PARENT)


def test_match_returns_longest_prefix_and_its_last_hash():
    registry = PrefixCacheRegistry()
    registry.register_kv([5, 3, 9], [11, 12, 13])
    assert registry.match_kv_prefix([11, 12, 13]) == ([5, 3, 9], 13)
    assert registry.match_kv_prefix([11, 12, 99, 100]) == ([5, 3], 12)
    assert registry.match_kv_prefix([11]) == ([5], 11)
    assert registry.match_kv_prefix([99, 12]) == ([], NO_PARENT)


def test_match_stops_at_a_gap_when_the_chain_invariant_is_broken():
    registry = PrefixCacheRegistry()
    registry.register_kv([0, 2], [11, 13])  # 12 missing: a caller broke the chain
    assert registry.match_kv_prefix([11, 12, 13]) == ([0], 11)
    assert registry.match_kv_prefix([10, 12, 13]) == ([], NO_PARENT)


@settings(deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=8, unique=True),
    st.integers(0, 8),
    st.lists(st.integers(1, 12), max_size=4, unique=True),
)
def test_match_equals_brute_force_on_prefix_closed_registries(chain, registered, tail):
    """With a registered prefix of a chain, the match is that prefix, cut where the query leaves it."""
    registry = PrefixCacheRegistry()
    registered = min(registered, len(chain))
    registry.register_kv([100 + i for i in range(registered)], chain[:registered])
    for cut in range(len(chain) + 1):
        query = chain[:cut] + [h + 1000 for h in tail]
        expected = min(cut, registered)
        ids, parent = registry.match_kv_prefix(query)
        assert ids == [100 + i for i in range(expected)]
        assert parent == (chain[expected - 1] if expected else NO_PARENT)


# ---- register_kv / evict_kv -----------------------------------------------------------------


def test_register_kv_validates_its_input():
    registry = PrefixCacheRegistry()
    with pytest.raises(ValueError):
        registry.register_kv([1, 2], [11])
    with pytest.raises(ValueError):
        registry.register_kv([1], [0])
    with pytest.raises(ValueError):
        registry.register_kv([1], [UNSET_HASH])


def test_evict_kv_returns_only_hashes_actually_removed_and_ignores_unset():
    registry = PrefixCacheRegistry()
    registry.register_kv([0, 1], [11, 12])
    assert registry.evict_kv([UNSET_HASH, 12, 99, 12]) == {12}
    assert registry.kv_hash_to_block_id == {11: 0}
    assert registry.evict_kv([]) == set()
    assert registry.evict_kv([12]) == set()


def test_evicting_kv_cascades_to_mamba_and_fires_the_callback():
    registry, calls = _with_mamba_log()
    registry.register_kv([0, 1, 2], [11, 12, 13])
    registry.register_mamba([7, 8], [12, 13])
    assert registry.evict_kv([11, 12]) == {11, 12}
    assert registry.mamba_hash_to_block_id == {13: 8}
    assert calls == [[7]]


def test_evicting_kv_without_mamba_entries_does_not_fire_the_callback():
    registry, calls = _with_mamba_log()
    registry.register_kv([0], [11])
    registry.evict_kv([11])
    assert calls == []


# ---- Mamba ----------------------------------------------------------------------------------


def test_register_mamba_skips_non_positive_hashes():
    registry = PrefixCacheRegistry()
    registry.register_mamba([1, 2, 3, 4], [UNSET_HASH, 0, 21, -5])
    assert registry.mamba_hash_to_block_id == {21: 3}
    with pytest.raises(ValueError):
        registry.register_mamba([1], [21, 22])


def test_match_mamba_farthest_is_one_past_the_farthest_cached_state():
    registry = PrefixCacheRegistry()
    assert registry.match_mamba_farthest([]) == 0
    assert registry.match_mamba_farthest([21, 22]) == 0
    registry.register_mamba([0, 1], [21, 23])  # Mamba states need not be prefix-closed
    assert registry.match_mamba_farthest([21, 22, 23, 24]) == 3
    assert registry.match_mamba_farthest([21, 22]) == 1
    assert registry.match_mamba_farthest([99, 98, 23]) == 3


def test_find_mamba_backoff_is_bounded_by_search_len():
    registry = PrefixCacheRegistry()
    registry.register_mamba([0, 1], [21, 23])
    hashes = [21, 22, 23, 24]
    assert registry.find_mamba_backoff(hashes, 4) == 3
    assert registry.find_mamba_backoff(hashes, 3) == 3
    assert registry.find_mamba_backoff(hashes, 2) == 1  # backs off below the raw match
    assert registry.find_mamba_backoff(hashes, 1) == 1
    assert registry.find_mamba_backoff(hashes, 0) == 0
    assert registry.find_mamba_backoff(hashes, 100) == 3  # bound past the end is clamped
    assert registry.find_mamba_backoff([], 5) == 0


@pytest.mark.parametrize(("hashes", "search_len"), [([], -1), ([21, 22, 23, 24], -3)])
def test_find_mamba_backoff_never_returns_a_negative_index(hashes, search_len):
    registry = PrefixCacheRegistry()
    registry.register_mamba([0, 1], [21, 23])
    assert 0 <= registry.find_mamba_backoff(hashes, search_len) <= len(hashes)


@settings(deadline=None)
@given(
    st.lists(st.integers(1, 8), max_size=10),
    st.sets(st.integers(1, 8), max_size=8),
    st.integers(0, 12),
)
def test_find_mamba_backoff_equals_brute_force(hashes, cached, search_len):
    registry = PrefixCacheRegistry()
    cached = sorted(cached)
    registry.register_mamba(list(range(len(cached))), cached)
    bound = max(0, min(search_len, len(hashes)))
    expected = max((i + 1 for i in range(bound) if hashes[i] in cached), default=0)
    assert registry.find_mamba_backoff(hashes, search_len) == expected
    assert registry.match_mamba_farthest(hashes) == registry.find_mamba_backoff(hashes, len(hashes))


def test_evict_mamba_reports_removed_hashes_and_freed_block_ids():
    registry, calls = _with_mamba_log()
    registry.register_mamba([4, 5, 6], [21, 22, 23])
    assert registry.evict_mamba([UNSET_HASH, 22, 99, 23, 22]) == {22, 23}
    assert sorted(calls[0]) == [5, 6] and len(calls) == 1
    assert registry.evict_mamba([99]) == set()
    assert len(calls) == 1  # nothing freed, no callback


def test_evict_mamba_without_callback():
    registry = PrefixCacheRegistry()
    registry.register_mamba([4], [21])
    registry.set_mamba_evict_callback(None)
    assert registry.evict_mamba([21]) == {21}


# ---- clearing -------------------------------------------------------------------------------


def test_clear_kv_drops_mamba_too():
    registry, calls = _with_mamba_log()
    registry.register_kv([0, 1], [11, 12])
    registry.register_mamba([7], [12])
    registry.clear_kv()
    assert registry.kv_hash_to_block_id == {} and registry.mamba_hash_to_block_id == {}
    assert calls == [[7]]


def test_clear_mamba_keeps_kv():
    registry, calls = _with_mamba_log()
    registry.register_kv([0], [11])
    registry.register_mamba([7], [11])
    registry.clear_mamba()
    assert registry.kv_hash_to_block_id == {11: 0} and registry.mamba_hash_to_block_id == {}
    assert calls == [[7]]
    registry.clear_mamba()
    assert calls == [[7]]  # empty clear fires nothing


def test_reset_drops_everything_and_nothing_matches():
    registry, calls = _with_mamba_log()
    registry.register_kv([0, 1], [11, 12])
    registry.register_mamba([7], [11])
    registry.reset()
    assert registry.match_kv_prefix([11, 12]) == ([], NO_PARENT)
    assert registry.match_mamba_farthest([11, 12]) == 0
    assert calls == []  # a reset is not an eviction: the slot owner frees its slots itself
