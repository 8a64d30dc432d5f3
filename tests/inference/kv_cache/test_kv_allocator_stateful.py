"""Stateful property test: engine-like requests drive the allocator, a reference model checks it.

A request has tokens (from a two-letter alphabet, so prefixes collide and get shared), matches
its cached prefix, allocates the rest, registers its full blocks as a chain, may grow, fork
(a sibling retains its full blocks) and finish (releases its blocks, often in one batch with
others, so ids repeat). The model keeps requests -> blocks (ref counts follow from it), the
registered hash of each block, the LRU clock and the content written into each block; after
every step the allocator's public state must equal it, including which blocks LRU evicted.
"""

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import event as note_event
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from inference.errors import BlockOverflowError
from inference.kv_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EvictionPolicy,
    KVBlockAllocator,
    KVEventHub,
    KVPoolStats,
    PromptLogprobsBlock,
    block_hashes,
)
from inference.kv_cache.hashing import NO_PARENT, UNSET_HASH

BS = 2
NUM_BLOCKS = 10
MAX_REQUESTS = 5
# Prompts that share prefixes, plus a random suffix: matches and duplicate computation are common.
PROMPTS = [[], [0, 1, 0, 1], [0, 1, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0], [1, 1, 0, 0, 1, 0]]
TOKENS = st.builds(
    lambda prompt, suffix: prompt + suffix, st.sampled_from(PROMPTS), st.lists(st.integers(0, 1), max_size=5)
)
EXTRA_KEYS = st.sampled_from([None, None, None, "adapter-1"])
RARELY = st.integers(0, 3)  # a destructive rule acts only when this draws 0


@dataclass
class Request:
    tokens: list[int]
    extra_key: object
    blocks: list[int]
    offered: int  # leading full blocks matched or already offered to `register`

    @property
    def num_full(self) -> int:
        return len(self.tokens) // BS

    def hashes(self) -> list[int]:
        return block_hashes(self.tokens, BS, extra_key=self.extra_key)

    def prefix(self, num_blocks: int) -> tuple:
        return (self.extra_key, tuple(self.tokens[: num_blocks * BS]))


class Model:
    """What the allocator should hold, derived without it."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.lru = policy is EvictionPolicy.LRU
        self.requests: dict[int, Request] = {}
        self.hash_of: dict[int, int] = {}  # registered block -> its hash
        self.parent_of: dict[int, int] = {}  # registered block -> parent block, -1 for a root
        self.ts = [0] * NUM_BLOCKS
        self.clock = 0
        self.hits = self.misses = 0
        self.content: dict[int, tuple] = {}  # block -> (extra_key, tokens) written into it, once full
        self.hash_prefix: dict[int, tuple] = {}  # hash -> (extra_key, tokens) it was registered for
        self.hash_parent: dict[int, int] = {}  # hash -> its chain parent's hash (0 for a root)

    def refs(self) -> Counter:
        return Counter(b for r in self.requests.values() for b in r.blocks)

    def block_of(self) -> dict[int, int]:
        return {h: b for b, h in self.hash_of.items()}

    def free(self) -> set[int]:
        return set(range(NUM_BLOCKS)) - set(self.refs()) - set(self.hash_of)

    def cached(self) -> set[int]:
        refs = self.refs()
        return {b for b in self.hash_of if refs[b] == 0}

    def match(self, hashes: list[int]) -> list[int]:
        block_of, out = self.block_of(), []
        for h in hashes:
            if h not in block_of:
                break
            out.append(block_of[h])
        return out

    def tick(self, block_ids: list[int]) -> None:
        self.clock += 1
        for b in block_ids:
            self.ts[b] = self.clock

    def unregister(self, block_id: int) -> None:
        del self.hash_of[block_id]
        self.parent_of.pop(block_id, None)

    def evict(self, k: int) -> list[int]:
        """LRU: repeatedly the oldest (timestamp, then id, as the heap orders) cached leaf."""
        refs = self.refs()
        children = Counter(p for p in self.parent_of.values() if p >= 0)
        candidates = {b for b in self.hash_of if refs[b] == 0}
        victims = []
        for _ in range(k):
            leaves = [b for b in candidates if children[b] == 0]
            assert leaves, "owners hold prefix-closed chains, so every cached block can be peeled"
            victim = min(leaves, key=lambda b: (self.ts[b], b))
            victims.append(victim)
            candidates.discard(victim)
            children[self.parent_of.get(victim, -1)] -= 1
            self.unregister(victim)
        return victims

    def expected_register_count(self, ids: list[int], hashes: list[int], parent: int) -> int:
        if parent >= 0 and parent not in self.hash_of:
            return 0
        block_of, refs, count = self.block_of(), self.refs(), 0
        for b, h in zip(ids, hashes):
            if h in block_of or b in self.hash_of or refs[b] <= 0:
                break
            count += 1
        return count

    def write_full_blocks(self, req: Request, start: int) -> None:
        for i in range(start, req.num_full):
            self.content[req.blocks[i]] = req.prefix(i + 1)


def tagged_scores(block_hash: int) -> PromptLogprobsBlock:
    """Prompt scores tagged with the hash of the block they were cached with."""
    block = PromptLogprobsBlock(BS, 0)
    block.next_token_id = block_hash
    return block


class AllocatorMachine(RuleBasedStateMachine):
    POLICY = EvictionPolicy.REF_ZERO

    def __init__(self) -> None:
        super().__init__()
        self.hub = KVEventHub(record=True)
        self.alloc = KVBlockAllocator(NUM_BLOCKS, BS, self.POLICY, events=self.hub)
        self.model = Model(self.POLICY)
        self.next_request_id = 0
        self.announced: dict[int, int] = {}  # hash -> block id, as the published events tell it

    # ---- helpers -----------------------------------------------------------------------------

    def _snapshot(self) -> tuple:
        alloc = self.alloc
        timestamps = alloc.state.block_timestamps
        return (
            alloc.state.block_ref_counts.tolist(),
            alloc.state.block_hashes.tolist(),
            None if timestamps is None else timestamps.tolist(),
            dict(alloc.registry.kv_hash_to_block_id),
            alloc.free_block_ids(),
            alloc.stats(),
            alloc.available,
            alloc.lru_clock,
        )

    def _allocate(self, n: int) -> list[int] | None:
        """Allocate as the model predicts: overflow changes nothing, else evict exactly the LRU set."""
        m = self.model
        free, cached = m.free(), (m.cached() if m.lru else set())
        if n > len(free) + len(cached):
            self._drain()
            before = self._snapshot()
            with pytest.raises(BlockOverflowError) as info:
                self.alloc.allocate(n)
            assert info.value.is_transient == (n <= NUM_BLOCKS)
            assert self._snapshot() == before
            assert self.hub.take_events() == []
            note_event("allocate: overflow")
            return None
        victims = m.evict(n - len(free)) if n > len(free) else []
        got = self.alloc.allocate(n)
        assert len(got) == n and len(set(got)) == n
        assert set(got) <= free | set(victims)
        if victims:
            assert set(got) == free | set(victims)
            note_event("allocate: evicted LRU leaves")
            if len(victims) > 1:
                note_event("allocate: evicted several blocks")
        if n:
            m.tick(got)
        for b in got:
            m.content.pop(b, None)  # nothing is written into a fresh block yet
        return got

    def _release(self, request_ids: list[int]) -> None:
        m = self.model
        ids = [b for rid in request_ids for b in m.requests[rid].blocks]
        if len(ids) != len(set(ids)):
            note_event("release: duplicate ids in one batch")
        self.alloc.release(ids)
        for rid in request_ids:
            del m.requests[rid]
        if ids:
            m.tick(ids)
        if not m.lru:
            refs = m.refs()
            for b in set(ids):
                if refs[b] == 0 and b in m.hash_of:
                    m.unregister(b)

    def _add_request(self, req: Request) -> int:
        rid = self.next_request_id
        self.next_request_id += 1
        self.model.requests[rid] = req
        return rid

    def _drain(self) -> None:
        for event in self.hub.take_events():
            if isinstance(event, BlockStored):
                assert event.block_size == BS
                for h, b in zip(event.block_hashes, event.block_ids):
                    assert h not in self.announced
                    self.announced[h] = b
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert h in self.announced, "removal of a hash never announced"
                    del self.announced[h]
            else:
                assert isinstance(event, AllBlocksCleared)
                self.announced.clear()

    # ---- rules -------------------------------------------------------------------------------

    @rule(tokens=TOKENS, extra_key=EXTRA_KEYS, register_now=st.booleans())
    def new_request(self, tokens, extra_key, register_now):
        m = self.model
        if len(m.requests) >= MAX_REQUESTS:
            return
        req = Request(list(tokens), extra_key, [], 0)
        hashes = req.hashes()
        expected = m.match(hashes)
        refs = m.refs()
        assert self.alloc.peek_prefix(hashes) == (len(expected), sum(refs[b] == 0 for b in expected))
        matched = self.alloc.match_prefix(hashes)
        assert matched == expected
        if hashes:
            m.hits += len(matched)
            m.misses += len(hashes) - len(matched)
        for i, b in enumerate(matched):  # a match serves the very content this request needs
            assert m.content[b] == req.prefix(i + 1) == m.hash_prefix[hashes[i]]
        if matched:
            m.tick(matched)
            note_event("new_request: matched a cached prefix")
            if any(refs[b] == 0 for b in matched):
                note_event("new_request: revived a cached block")
        req.blocks, req.offered = list(matched), len(matched)
        rid = self._add_request(req)
        got = self._allocate(-(-len(tokens) // BS) - len(matched))
        if got is None:  # the engine gives up on the request and drops its matched prefix
            self._release([rid])
            return
        req.blocks += got
        m.write_full_blocks(req, len(matched))
        if register_now:  # after prefill; otherwise a later `register` step, maybe after a twin's
            self._register(req)

    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), min_size=1, max_size=5), register_now=st.booleans())
    def grow(self, data, extra, register_now):
        m = self.model
        if not m.requests:
            return
        req = m.requests[data.draw(st.sampled_from(sorted(m.requests)))]
        old_full, old_hashes = req.num_full, req.hashes()
        tokens = req.tokens + list(extra)
        parent = old_hashes[-1] if old_hashes else NO_PARENT
        continued = block_hashes(tokens[old_full * BS :], BS, parent_hash=parent, extra_key=req.extra_key)
        assert old_hashes + continued == block_hashes(tokens, BS, extra_key=req.extra_key)
        got = self._allocate(-(-len(tokens) // BS) - len(req.blocks))
        if got is None:
            return
        req.tokens = tokens
        req.blocks += got
        m.write_full_blocks(req, old_full)
        if register_now:
            self._register(req)

    @rule(data=st.data())
    def register(self, data):
        m = self.model
        if m.requests:
            self._register(m.requests[data.draw(st.sampled_from(sorted(m.requests)))])

    def _register(self, req: Request) -> None:
        m = self.model
        all_hashes, start, end = req.hashes(), req.offered, req.num_full
        ids, hashes = req.blocks[start:end], all_hashes[start:end]
        parent = req.blocks[start - 1] if start else -1
        expected = m.expected_register_count(ids, hashes, parent)
        scores = [tagged_scores(h) if h % 2 else None for h in hashes]  # some blocks carry prompt scores
        assert self.alloc.register(ids, hashes, parent, prompt_logprobs=scores) == expected
        if expected < len(ids):
            note_event("register: stopped early")
        for k in range(expected):
            b, h, pos = ids[k], hashes[k], start + k
            m.hash_of[b] = h
            m.parent_of[b] = parent if k == 0 else ids[k - 1]
            assert m.hash_prefix.setdefault(h, req.prefix(pos + 1)) == req.prefix(pos + 1)
            m.hash_parent[h] = all_hashes[pos - 1] if pos else NO_PARENT
        req.offered = end

    @rule(data=st.data())
    def fork(self, data):
        m = self.model
        if not m.requests or len(m.requests) >= MAX_REQUESTS:
            return
        req = m.requests[data.draw(st.sampled_from(sorted(m.requests)))]
        shared = req.blocks[: req.num_full]
        self.alloc.retain(shared)
        m.tick(shared)
        offered = min(req.offered, req.num_full)
        self._add_request(Request(req.tokens[: req.num_full * BS], req.extra_key, list(shared), offered))

    @rule(data=st.data())
    def finish(self, data):
        ids = sorted(self.model.requests)
        if not ids:
            return
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True))
        self._release(chosen)

    @rule(rarely=RARELY)
    def finish_all(self, rarely):
        if rarely:
            return
        self._release(sorted(self.model.requests))
        assert self.alloc.active == 0

    @rule()
    def publish(self):
        self.hub.publish_pending()
        self._drain()
        assert self.announced == self.alloc.registry.kv_hash_to_block_id

    @rule(rarely=RARELY)
    def reset_prefix_cache(self, rarely):
        if rarely:
            return
        m = self.model
        self.alloc.reset_prefix_cache()
        m.hash_of.clear()
        m.parent_of.clear()
        for h in list(m.hash_prefix) + [h for r in m.requests.values() for h in r.hashes()]:
            assert self.alloc.peek_prefix([h]) == (0, 0)

    @rule(rarely=st.integers(0, 7))
    def reset(self, rarely):
        if rarely:
            return
        m = self.model
        self.alloc.reset()
        m.requests.clear()
        m.hash_of.clear()
        m.parent_of.clear()
        m.ts = [0] * NUM_BLOCKS

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def allocator_matches_model(self):
        self._drain()
        m, alloc, state = self.model, self.alloc, self.alloc.state
        refs = m.refs()
        ref_counts = state.block_ref_counts.tolist()
        assert min(ref_counts) >= 0
        assert ref_counts == [refs[b] for b in range(NUM_BLOCKS)]
        assert state.block_hashes.tolist() == [m.hash_of.get(b, UNSET_HASH) for b in range(NUM_BLOCKS)]
        assert alloc.registry.kv_hash_to_block_id == m.block_of()
        free = alloc.free_block_ids()
        assert len(free) == len(set(free)), "a block is in the free pool twice"
        assert set(free) == m.free()
        cached = m.cached()
        if not m.lru:
            assert not cached, "REF_ZERO keeps no cached reservoir"
        active = sum(1 for b in range(NUM_BLOCKS) if refs[b] > 0)
        stats = alloc.stats()
        assert stats == KVPoolStats(NUM_BLOCKS, len(free), active, len(cached), m.hits, m.misses)
        assert stats.free + stats.active + stats.cached == stats.total
        assert alloc.available == len(free) + len(cached)
        assert alloc.lru_clock == m.clock
        if m.lru:
            timestamps = state.block_timestamps.tolist()
            assert all(timestamps[b] == m.ts[b] for b in range(NUM_BLOCKS) if b not in m.free())

    @invariant()
    def cached_children_have_cached_ancestors(self):
        m = self.model
        registered = set(m.hash_of.values())
        for b, h in m.hash_of.items():
            parent_hash = m.hash_parent[h]
            assert parent_hash == NO_PARENT or parent_hash in registered
            assert m.content[b] == m.hash_prefix[h], "a block registered under a hash holds other tokens"
            parent = m.parent_of[b]
            assert parent == -1 or m.hash_of.get(parent) == parent_hash

    @invariant()
    def prompt_scores_live_exactly_as_long_as_their_hash(self):
        state = self.alloc.state
        for b, block in state.prompt_logprobs.items():
            assert state.hash_of(b) == block.next_token_id, "prompt scores outlived the hash they were cached with"
        assert sum(h % 2 for h in self.alloc.registry.kv_hash_to_block_id) == len(state.prompt_logprobs)

    @invariant()
    def announced_blocks_are_served(self):
        registry = self.alloc.registry.kv_hash_to_block_id
        assert all(registry.get(h) == b for h, b in self.announced.items())

    @invariant()
    def pool_is_whole_when_nobody_holds_a_block(self):
        if self.model.requests:
            return
        stats = self.alloc.stats()
        assert stats.active == 0
        if not self.model.lru:
            assert stats.free == NUM_BLOCKS
            assert self.alloc.registry.kv_hash_to_block_id == {}


class LRUAllocatorMachine(AllocatorMachine):
    POLICY = EvictionPolicy.LRU


_SETTINGS = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestRefZeroAllocator = AllocatorMachine.TestCase
TestRefZeroAllocator.settings = _SETTINGS
TestLRUAllocator = LRUAllocatorMachine.TestCase
TestLRUAllocator.settings = _SETTINGS
