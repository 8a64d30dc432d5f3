"""Per-step bookkeeping of the requests in flight: slots, tokens, block tables, pause and evict.

Every running request owns a slot. Its tokens, log-probs and policy versions live in per-slot
numpy buffers (indexed by token position), and its KV blocks in a per-slot block table, so a
decode step over hundreds of requests is a handful of vectorised gathers, not a Python loop.

Per slot: `seq_len` tokens are known (prompt + generated), the first `kv_len` of them have their
K/V in the cache, `num_blocks` blocks cover them, and the first `num_registered` of those blocks
are in the prefix cache (or came from it). A decode-ready slot has `kv_len == seq_len - 1`.
Paused slots keep their blocks but do not run; evicted ones give their blocks back and return
to the waiting queue to be recomputed (their tokens are kept on the `Request`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from inference.cache.snapshots import StateSnapshots
from inference.cache.state_pool import StatePool
from inference.config import InferenceConfig
from inference.errors import BlockOverflowError
from inference.kv_cache.allocator import KVBlockAllocator
from inference.kv_cache.block_key import BlockKey
from inference.request import FinishReason, Request, RequestStatus
from inference.sampling.grammar import GrammarSlots
from inference.sampling.params import LogprobsMode
from inference.sampling.processor_state import ProcessorState
from inference.sched.prefix_matching import PrefixMatching
from inference.sched.prompt_logprobs import PromptScores
from inference.sched.state_prefix import StatePrefixCache


class DynamicInferenceContext(PrefixMatching):
    """Slots, token buffers and block tables of the requests in flight (see module docstring).

    Invariants: a slot is in exactly one of `free_slots`, `active`, `paused`; the blocks in a
    slot's table row `[:num_blocks]` hold one reference each on behalf of that slot. The policy
    version is read from its owner (`version_of`), never stored here.
    """

    def __init__(
        self,
        config: InferenceConfig,
        allocator: KVBlockAllocator,
        version_of: Callable[[], int] = lambda: 0,
        states: StatePool | None = None,
        snapshots: StateSnapshots | None = None,
        *,
        vocab_size: int,
        eos_token_ids=(),
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.states = states  # per-request recurrent state, one slot per request in a slot
        self._version_of = version_of
        self.block_size = config.block_size
        n, length = config.max_requests, config.max_sequence_length
        self.tokens = np.zeros((n, length), dtype=np.int64)
        self.token_logprobs = np.zeros((n, length), dtype=np.float32)
        self.token_versions = np.zeros((n, length), dtype=np.int32)
        self.block_table = np.zeros((n, config.max_blocks_per_request), dtype=np.int32)
        self.seq_len = np.zeros(n, dtype=np.int64)
        self.kv_len = np.zeros(n, dtype=np.int64)
        self.prompt_len = np.zeros(n, dtype=np.int64)
        self.max_len = np.zeros(n, dtype=np.int64)
        self.num_blocks = np.zeros(n, dtype=np.int64)
        self.num_registered = np.zeros(n, dtype=np.int64)
        self.cache_broken = np.zeros(n, dtype=bool)
        # a slot that registers nothing more because another block serves its hash, but whose
        # prompt scores can still be cached with that block (see register_full_blocks)
        self.offers_scores = np.zeros(n, dtype=bool)
        self.state_slot = np.full(n, -1, dtype=np.int64)  # the request's row in the state pool
        # the slot's state was computed by the current weights from its tokens alone: it may be snapshotted
        self.state_cacheable = np.zeros(n, dtype=bool)
        # where the slot's cached KV ended beyond its farthest state snapshot: a chunk ends there (0: none)
        self.state_branch = np.zeros(n, dtype=np.int64)
        # models with state: a KV prefix is served only with the state at its end (see state_prefix)
        self.state_prefix = (StatePrefixCache(snapshots, states, allocator, config.block_size)
                             if snapshots is not None and states is not None else None)
        self.hashes: list[list[int]] = [[] for _ in range(n)]
        self._chain_keys: dict[tuple, tuple[BlockKey, bytes]] = {}
        self.requests: list[Request | None] = [None] * n
        # per-slot sampling parameters, gathered into the sampler's row tensors each step
        self.temperature = torch.zeros(n, dtype=torch.float32)
        self.top_k = torch.zeros(n, dtype=torch.int64)
        self.top_p = torch.ones(n, dtype=torch.float32)
        self.min_p = torch.zeros(n, dtype=torch.float32)
        self.processed_logprobs = torch.zeros(n, dtype=torch.bool)
        self.generators: list[torch.Generator | None] = [None] * n
        self.num_top_logprobs = np.zeros(n, dtype=np.int64)
        self.wants_prompt_logprobs = np.zeros(n, dtype=bool)
        # the slot's chain is keyed by the current policy version alone (no cache salt, version salt or adapter)
        self.plain_key = np.zeros(n, dtype=bool)
        self.streams_tokens = np.zeros(n, dtype=bool)  # the request's caller wants every token as sampled
        self.returns_routes = np.zeros(n, dtype=bool)  # MoE: the request records its routing per token
        self.lora_id = np.full(n, -1, dtype=np.int64)  # the resident id of the slot's LoRA adapter (-1: none)
        self.eos_token_ids = list(eos_token_ids)
        # the tokens that end the slot's request: its stop ids and, unless it ignores EOS, the
        # model's EOS ids (-1 pads; widened when a request has more)
        self.finish_ids = np.full((n, 4), -1, dtype=np.int64)
        # logit processors' per-slot state (penalty counts kept as tokens are appended)
        self.processors = ProcessorState(n, vocab_size, eos_token_ids)
        self.grammars = GrammarSlots(n, vocab_size)  # structured outputs: a matcher per constrained slot
        self.free_slots: list[int] = list(range(n - 1, -1, -1))
        self.active: list[int] = []
        self.paused: list[int] = []
        self.cross_version_hits = 0  # matched blocks an older version's weights (or adapter) computed (SALTED only)
        self.prefill_tokens = 0  # tokens whose K/V was computed by a prefill (not served by cache)
        self.prefix_cached_tokens = 0  # tokens whose K/V a request took from the prefix cache
        self.prompt_logprobs_cached = 0  # prompt positions whose scores came with cached blocks
        self.blocks_detached = False  # see detach_blocks

    # ---- queries -----------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._version_of()

    @property
    def active_request_count(self) -> int:
        return len(self.active)

    @property
    def paused_request_count(self) -> int:
        return len(self.paused)

    def has_unfinished_requests(self) -> bool:
        return bool(self.active or self.paused)

    def blocks_needed(self, slot: int, new_kv_len: int) -> int:
        """Blocks to add to `slot` so that its table covers `new_kv_len` tokens."""
        return max(0, -(-new_kv_len // self.block_size) - int(self.num_blocks[slot]))

    def paused_block_count(self) -> int:
        return int(self.num_blocks[self.paused].sum()) if self.paused else 0

    def get_kvcache_utilization_stats(self) -> dict:
        pool = self.allocator
        active_blocks = np.unique(np.concatenate(
            [self.block_table[s, : self.num_blocks[s]] for s in self.active]
        )) if self.active else np.empty(0)
        allocated = pool.total - pool.free
        return {
            "total_blocks": pool.total,
            "allocated_blocks": allocated,
            "cached_blocks": pool.cached,
            "active_unique_blocks": int(active_blocks.size),
            "allocated_utilization": allocated / pool.total,
            "active_utilization": active_blocks.size / pool.total,
            "active_request_count": len(self.active),
            "paused_request_count": len(self.paused),
            "paused_block_count": self.paused_block_count(),
        }

    # ---- admission ---------------------------------------------------------------------------

    def check_availability(self, req: Request, chunk_tokens: int) -> tuple[bool, bool, bool]:
        """(a slot is free, the token budget fits, the blocks fit) for admitting `req`."""
        cached, unheld = self.peek_cached_prefix(req)
        start = cached * self.block_size
        end = min(req.num_tokens, start + chunk_tokens)
        needed = -(-end // self.block_size) - cached
        return bool(self.free_slots), chunk_tokens > 0, needed <= self.allocator.available - unheld

    def peek_cached_prefix(self, req: Request) -> tuple[int, int]:
        """(cached leading blocks of `req`, how many of those nobody holds yet)."""
        if not self.uses_prefix_cache(req):
            return 0, 0
        return self.allocator.peek_prefix(self.prefix_to_match(req), key=self.block_key(req),
                                          current_version=self.rule_version(req))

    def add_request(self, req: Request, prefill_chunk_length: int) -> int:
        """Give `req` a slot, its tokens and the blocks of its first chunk; returns the chunk length.

        Cached prefix blocks are matched first (the prefill then starts after them). Raises
        `BlockOverflowError` with nothing changed when the chunk's blocks cannot be had.
        """
        tokens = req.all_token_ids
        given_up = 0
        if self.uses_prefix_cache(req):
            to_match, given_up = self._prefix_to_match(req)
            matched = self.allocator.match_prefix(to_match, len(self.matchable_hashes(req)), key=self.block_key(req),
                                                  current_version=self.rule_version(req))
            state, lora = self.allocator.state, req.lora
            # NOTE: a LoRA request's block must also come from its adapter's version (the key mixed
            # into the hash is what keeps them apart; this counts, by the recorded key, if it ever failed)
            self.cross_version_hits += sum(
                state.computed_by(b) != self.policy_version
                or (lora is not None and state.key_of(b).adapter_version != lora.version) for b in matched)
        else:
            matched = []
        kv_len = len(matched) * self.block_size
        chunk = min(prefill_chunk_length, len(tokens) - kv_len)
        branch = (len(matched) + given_up) * self.block_size if given_up else 0
        if self.state_prefix is not None:
            chunk = self.state_prefix.chunk(kv_len, chunk, len(tokens), branch)
        try:
            fresh = self.allocator.allocate(max(0, -(-(kv_len + chunk) // self.block_size) - len(matched)))
        except BlockOverflowError:
            self.allocator.release(matched)
            raise
        self.prefix_cached_tokens += len(matched) * self.block_size
        if req.cached_tokens is None:  # NOTE: what its first prefill took; a recompute's hits are the engine's
            req.cached_tokens = len(matched) * self.block_size
        if req.params.prompt_logprobs is not None:  # NOTE: each admission scores the prompt afresh
            req.prompt_scores = PromptScores.admitted(len(req.prompt_token_ids), req.params.prompt_logprobs,
                                                      self.allocator, matched)
            self.prompt_logprobs_cached += int(req.prompt_scores.known.sum())
        slot = self.free_slots.pop()
        self._take_state_slot(slot)
        if self.state_prefix is not None:  # NOTE: copies the snapshot at the matched prefix's end
            self.state_prefix.admitted(self.matchable_hashes(req), len(matched), given_up, int(self.state_slot[slot]))
        self.state_cacheable[slot] = True
        self.state_branch[slot] = branch
        n = len(tokens)
        self.tokens[slot, :n] = tokens
        self.token_logprobs[slot, len(req.prompt_token_ids) : n] = req.logprobs
        self.token_versions[slot, len(req.prompt_token_ids) : n] = req.token_versions
        self.seq_len[slot] = n
        self.kv_len[slot] = kv_len
        self.prompt_len[slot] = len(req.prompt_token_ids)
        self.max_len[slot] = min(req.max_total_tokens, self.config.max_sequence_length)
        blocks = matched + fresh
        self.block_table[slot, : len(blocks)] = blocks
        self.num_blocks[slot] = len(blocks)
        self.num_registered[slot] = len(matched)
        self.cache_broken[slot] = False
        self.offers_scores[slot] = False
        self.hashes[slot] = self.matchable_hashes(req)[: len(matched)] if matched else []
        self._bind_slot(slot, req)
        req.status = RequestStatus.RUNNING
        self.active.append(slot)
        return chunk

    def fork(self, parent_slot: int, child: Request) -> int | None:
        """Put `child` (a sample of the same prompt) in a slot sharing the parent's prompt blocks.

        Full blocks are shared (one more reference each); the last partial block gets a fresh
        block the caller fills by copying the parent's KV once it is written. Returns the child's
        slot, or None (nothing changed) when no slot or block is free.
        """
        full = int(self.prompt_len[parent_slot]) // self.block_size
        total = int(self.num_blocks[parent_slot])
        if not self.free_slots:
            return None
        try:
            fresh = self.allocator.allocate(total - full)
        except BlockOverflowError:
            return None
        shared = self.block_table[parent_slot, :full].tolist()
        self.allocator.retain(shared)
        slot = self.free_slots.pop()
        self._take_state_slot(slot)
        n = int(self.seq_len[parent_slot])
        self.tokens[slot, :n] = self.tokens[parent_slot, :n]
        for name in ("seq_len", "kv_len", "prompt_len"):
            getattr(self, name)[slot] = getattr(self, name)[parent_slot]
        self.max_len[slot] = min(child.max_total_tokens, self.config.max_sequence_length)  # its own max_tokens
        self.block_table[slot, :full] = shared
        self.block_table[slot, full:total] = fresh
        self.state_cacheable[slot] = self.state_cacheable[parent_slot]
        self.num_blocks[slot] = total
        self.num_registered[slot] = full
        self.cache_broken[slot] = False
        self.offers_scores[slot] = False
        self.hashes[slot] = []
        child.prompt_scores = self.requests[parent_slot].prompt_scores  # NOTE: complete, never written again
        routes = self.requests[parent_slot].routed_experts
        if routes is not None:  # the prompt's routing, computed once for the group
            child.routed_experts = routes.copy()
        self._bind_slot(slot, child)
        child.status = RequestStatus.RUNNING
        self.active.append(slot)
        return slot

    def _take_state_slot(self, slot: int) -> None:
        if self.states is not None:
            state = self.states.allocate_slot()
            if state is None:  # NOTE: the pool has a slot per request slot; this is a bug, not load
                raise RuntimeError("state pool exhausted although a request slot was free")
            self.state_slot[slot] = state

    def held_state_slots(self) -> list[int]:
        """State-pool rows held by the requests in slots (e.g. to copy them to host)."""
        return [int(self.state_slot[s]) for s in self.active + self.paused] if self.states is not None else []

    def _bind_slot(self, slot: int, req: Request) -> None:
        """Point `slot` at `req` and copy its sampling parameters into the per-slot arrays."""
        p = req.params
        self.requests[slot] = req
        self.temperature[slot] = p.temperature
        self.top_k[slot] = max(p.top_k, 0)
        self.top_p[slot] = p.top_p
        self.min_p[slot] = p.min_p
        self.processed_logprobs[slot] = p.logprobs_mode == LogprobsMode.PROCESSED
        self.generators[slot] = req.generator
        self.num_top_logprobs[slot] = p.logprobs or 0
        self.wants_prompt_logprobs[slot] = p.prompt_logprobs is not None
        self.plain_key[slot] = not req.salted and p.cache_salt is None and req.lora is None
        self.streams_tokens[slot] = req.stream_tokens
        self.returns_routes[slot] = p.return_routed_experts
        self.lora_id[slot] = -1 if req.lora is None else req.lora.id
        stops = [*p.stop_token_ids, *([] if p.ignore_eos else self.eos_token_ids)]
        if len(stops) > self.finish_ids.shape[1]:
            wider = np.full((self.finish_ids.shape[0], len(stops)), -1, dtype=np.int64)
            wider[:, : self.finish_ids.shape[1]] = self.finish_ids
            self.finish_ids = wider
        self.finish_ids[slot] = -1
        self.finish_ids[slot, : len(stops)] = stops
        prompt_len, seq_len = int(self.prompt_len[slot]), int(self.seq_len[slot])
        self.processors.bind(slot, p, self.tokens[slot, :prompt_len], self.tokens[slot, prompt_len:seq_len])
        self.grammars.bind(slot, req.grammar, self.tokens[slot, prompt_len:seq_len])

    def grow(self, slot: int, new_kv_len: int) -> bool:
        """Make `slot`'s table cover `new_kv_len` tokens; False (nothing changed) if no block."""
        needed = self.blocks_needed(slot, new_kv_len)
        if needed == 0:
            return True
        try:
            fresh = self.allocator.allocate(needed)
        except BlockOverflowError:
            return False
        start = int(self.num_blocks[slot])
        self.block_table[slot, start : start + needed] = fresh
        self.num_blocks[slot] = start + needed
        return True

    def grow_each_by_one(self, slots: np.ndarray) -> bool:
        """Give each of `slots` (decodes whose next token starts a block) one more block, in one
        allocation; False, nothing changed, if the pool cannot supply them all at once."""
        ends = self.num_blocks[slots]
        if (ends != self.kv_len[slots] // self.block_size).any():
            return False  # NOTE: not one block each; the caller grows them one by one
        try:
            fresh = self.allocator.allocate(slots.size)
        except BlockOverflowError:
            return False
        self.block_table[slots, ends] = fresh
        self.num_blocks[slots] = ends + 1
        return True

    # ---- after a step ------------------------------------------------------------------------

    def finishes(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Per row whether `tokens[i]` ends the request of `slots[i]` (a stop id, or EOS unless ignored)."""
        return (self.finish_ids[slots] == tokens[:, None]).any(axis=1)

    def update_requests(
        self, slots: np.ndarray, new_tokens: np.ndarray, new_logprobs: np.ndarray
    ) -> list[tuple[Request, FinishReason]]:
        """Append each slot's sampled token; release the slots that hit a stop or their length.

        Vectorised over the slots; only finishing requests (and first tokens, for timing) are
        visited one by one. Returns the finished requests with their reasons.
        """
        pos = self.seq_len[slots]
        self.tokens[slots, pos] = new_tokens
        self.token_logprobs[slots, pos] = new_logprobs
        self.token_versions[slots, pos] = self._version_of()
        self.seq_len[slots] = pos + 1
        self.processors.append(slots, new_tokens)
        grammar_done = self.grammars.accept(slots, new_tokens)
        first = slots[pos == self.prompt_len[slots]]
        if first.size:
            now = time.perf_counter()
            for slot in first.tolist():
                self.requests[slot].first_token_time = now
        is_stop = self.finishes(slots, new_tokens)
        if grammar_done is not None:
            is_stop |= grammar_done
        done = is_stop | (pos + 1 >= self.max_len[slots])
        if not done.any():
            return []
        reasons = [FinishReason.STOP if s else FinishReason.LENGTH for s in is_stop[done].tolist()]
        return list(zip(self.release_memory_blocks_from_request_indexes(slots[done]), reasons))

    # ---- leaving a slot ----------------------------------------------------------------------

    def sync_request(self, slot: int) -> Request:
        """Copy the slot's generated tokens, log-probs and versions back onto its `Request`."""
        req = self.requests[slot]
        start, end = int(self.prompt_len[slot]), int(self.seq_len[slot])
        req.generated_token_ids = self.tokens[slot, start:end].tolist()
        req.logprobs = self.token_logprobs[slot, start:end].tolist()
        req.token_versions = self.token_versions[slot, start:end].tolist()
        if req.prompt_scores is not None:
            req.prompt_logprobs = req.prompt_scores.as_dicts(req.prompt_token_ids)
            req.prompt_logprob_ranks = req.prompt_scores.ranks_list()
        return req

    def release_memory_blocks_from_request_indexes(self, slots) -> list[Request]:
        """Free the slots (request indexes, not ids) and their blocks; returns their requests."""
        released = []
        for slot in [int(s) for s in slots]:
            req = self.sync_request(slot)
            if not self.blocks_detached:
                self.allocator.release(self.block_table[slot, : self.num_blocks[slot]].tolist())
            self.num_blocks[slot] = 0
            if self.states is not None:
                self.states.free_slot(int(self.state_slot[slot]))
                self.state_slot[slot] = -1
            self.hashes[slot] = []
            self.requests[slot] = None
            self.generators[slot] = None
            self.processors.release(slot)
            self.grammars.release(slot)
            if slot in self.active:
                self.active.remove(slot)
            else:
                self.paused.remove(slot)
            self.free_slots.append(slot)
            released.append(req)
        return released

    def pause(self, slot: int) -> None:
        self.active.remove(slot)
        self.paused.append(slot)
        self.requests[slot].status = RequestStatus.PAUSED

    def resume_paused_requests(self) -> int:
        """Resume paused slots, oldest first, while the block each needs can be had."""
        resumed = 0
        while self.paused:
            slot = self.paused[0]
            if not self.grow(slot, int(self.kv_len[slot]) + 1):
                break
            self.paused.pop(0)
            self.active.append(slot)
            self.requests[slot].status = RequestStatus.RUNNING
            resumed += 1
        return resumed

    def evict_overflow_paused_requests(self, force_one: bool = False) -> list[Request]:
        """Evict the most recently paused requests while paused blocks exceed their budget.

        `force_one` evicts at least one (nothing else can run: the paused hold the pool).
        Evicted requests lose their blocks and must be recomputed from their tokens; the
        scheduler queues them again (and counts the preemption).
        """
        if not self.paused:
            return []
        budget = self.config.resolve_paused_block_budget(self.allocator.total)
        evicted = []
        while self.paused and (self.paused_block_count() > budget or (force_one and not evicted)):
            slot = self.paused[-1]
            evicted.extend(self.release_memory_blocks_from_request_indexes([slot]))
            # NOTE: the blocks just freed let older paused ones go on, instead of evicting them too (a livelock)
            self.resume_paused_requests()
        return evicted

    def reset(self, preserve_prefix_cache: bool = False) -> None:
        """Forget every request and free every block (the prefix cache survives if asked)."""
        if self.states is not None:
            for slot in self.active + self.paused:
                self.states.free_slot(int(self.state_slot[slot]))
            self.state_slot[:] = -1
        if preserve_prefix_cache:
            for slot in self.active + self.paused:
                self.allocator.release(self.block_table[slot, : self.num_blocks[slot]].tolist())
        else:
            self.allocator.reset()
        self.num_blocks[:] = 0
        self.processors.reset()
        self.grammars.reset()
        self.hashes = [[] for _ in range(self.config.max_requests)]
        self.requests = [None] * self.config.max_requests
        self.free_slots = list(range(self.config.max_requests - 1, -1, -1))
        self.active, self.paused = [], []
