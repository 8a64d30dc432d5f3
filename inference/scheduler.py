"""Decides, each step, which requests run and how many tokens each computes.

Order of business (oldest work first, so nothing starves):
1. resume paused requests, oldest first, while a block can be had for each;
2. decode-ready requests get the block their next token needs, or are paused;
3. paused requests past their block budget are evicted (to be recomputed later);
4. the token budget left after decode goes to running prefills, then to new requests (FIFO),
   each chunk at most `chunked_prefill_size` tokens and only as many as free blocks allow.
If nothing at all can run while requests hold the pool, the newest one is evicted: progress is
guaranteed as long as one request fits the pool, which admission checks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from inference.context import DynamicInferenceContext
from inference.errors import BlockOverflowError
from inference.request import Request, RequestStatus


@dataclass(slots=True)
class StepPlan:
    """The requests of one step: `slots[i]` computes `query_lens[i]` tokens; decodes come first."""

    slots: np.ndarray
    query_lens: np.ndarray
    num_decode: int
    evicted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.slots.size == 0


ADMISSION_SCAN = 256  # waiting requests looked at per step (bounds the scheduler's per-step work)


class Scheduler:
    """Owns the waiting queue; admits, pauses, resumes and evicts through the context."""

    def __init__(self, context: DynamicInferenceContext) -> None:
        self.ctx = context
        self.config = context.config
        self.waiting: deque[Request] = deque()
        self.reserved_slots = 0  # slots promised to forked samples of groups being prefilled
        self.watermark_blocks = max(1, context.allocator.total // 100)

    def add(self, req: Request, front: bool = False) -> None:
        req.status = RequestStatus.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(req)

    def schedule(self) -> StepPlan:
        ctx = self.ctx
        evicted: list[Request] = []
        ctx.resume_paused_requests()
        decode = self._schedule_decodes()
        evicted += ctx.evict_overflow_paused_requests()
        budget = self.config.max_tokens - len(decode)
        prefill_slots, prefill_lens = self._schedule_prefills(budget)
        if not decode and not prefill_slots and ctx.has_unfinished_requests():
            evicted += self._evict_newest()
        for req in reversed(evicted):
            self.reserved_slots -= len(req.fork_children)  # re-reserved when it is admitted again
            self.add(req, front=True)
        slots = np.array(decode + prefill_slots, dtype=np.int64)
        lens = np.ones(slots.size, dtype=np.int64)
        lens[len(decode) :] = prefill_lens
        return StepPlan(slots, lens, len(decode), evicted)

    def _schedule_decodes(self) -> list[int]:
        ctx = self.ctx
        if not ctx.active:
            return []
        active = np.array(ctx.active, dtype=np.int64)
        ready = active[ctx.kv_len[active] == ctx.seq_len[active] - 1]
        needs_block = ready[ctx.kv_len[ready] // ctx.block_size >= ctx.num_blocks[ready]]
        if needs_block.size == 0:
            return ready.tolist()
        paused = set()
        for slot in needs_block.tolist():
            if not ctx.grow(slot, int(ctx.kv_len[slot]) + 1):
                ctx.pause(slot)
                paused.add(slot)
        return [s for s in ready.tolist() if s not in paused]

    def _schedule_prefills(self, budget: int) -> tuple[list[int], list[int]]:
        ctx, chunk_cap = self.ctx, self.config.chunked_prefill_size
        slots: list[int] = []
        lens: list[int] = []
        active = np.array(ctx.active, dtype=np.int64)
        prefilling = active[ctx.seq_len[active] - ctx.kv_len[active] > 1] if active.size else active
        for slot in prefilling.tolist():  # NOTE: decode-ready slots (one token left) run as decodes
            if budget <= 0:
                break
            todo = int(ctx.seq_len[slot] - ctx.kv_len[slot])
            chunk = self._fit_chunk(slot, min(todo, chunk_cap, budget))
            if chunk > 0:
                slots.append(slot)
                lens.append(chunk)
                budget -= chunk
        being_prefilled = self._first_blocks_being_prefilled(prefilling)
        index = 0
        while index < min(len(self.waiting), ADMISSION_SCAN) and budget > 0 and not ctx.paused:
            req = self.waiting[index]
            first = self._first_block_hash(req)
            if first is not None and first in being_prefilled:
                # NOTE: the same prompt start is being prefilled right now: wait a step and match
                # its blocks from the cache instead of computing them again (n=1 GRPO samples)
                index += 1
                continue
            group = 1 + len(req.fork_children)
            if len(ctx.free_slots) - self.reserved_slots < group:
                break
            chunk = min(chunk_cap, budget)
            _, _, fits = ctx.check_availability(req, chunk)
            if not fits:
                chunk = self._chunk_within_free_blocks(req, chunk)
                if chunk <= 0:
                    break
            try:
                slot_chunk = ctx.add_request(req, chunk)
            except BlockOverflowError:
                break  # NOTE: nothing changed; it stays in line
            del self.waiting[index]
            self.reserved_slots += group - 1
            slot = ctx.active[-1]
            if first is not None and ctx.num_registered[slot] < len(req.hash_cache):
                being_prefilled.add(first)
            if slot_chunk > 0:
                slots.append(slot)
                lens.append(slot_chunk)
                budget -= slot_chunk
        return slots, lens

    def _first_block_hash(self, req: Request) -> int | None:
        """Hash of the request's first full block when it can share blocks through the cache."""
        if not self.ctx.uses_prefix_cache(req):
            return None
        hashes = self.ctx.matchable_hashes(req)
        return hashes[0] if hashes else None

    def _first_blocks_being_prefilled(self, prefilling: np.ndarray) -> set[int]:
        """First-block hashes of the running prefills that will register new full blocks."""
        ctx = self.ctx
        heads = set()
        for slot in prefilling.tolist():
            req = ctx.requests[slot]
            if not ctx.cache_broken[slot] and req.hash_cache and ctx.num_registered[slot] < len(req.hash_cache):
                heads.add(req.hash_cache[0])
        return heads

    def _fit_chunk(self, slot: int, chunk: int) -> int:
        """Shrink `chunk` to what the slot's blocks plus free blocks can hold, and grow into it."""
        ctx = self.ctx
        kv_len = int(ctx.kv_len[slot])
        room = (int(ctx.num_blocks[slot]) + ctx.allocator.available) * ctx.block_size - kv_len
        chunk = min(chunk, room)
        if chunk > 0 and not ctx.grow(slot, kv_len + chunk):
            return 0
        return max(chunk, 0)

    def _chunk_within_free_blocks(self, req: Request, chunk: int) -> int:
        """The largest first chunk of `req` that free blocks (above the watermark) can hold."""
        _, unheld = self.ctx.peek_cached_prefix(req)
        spare = self.ctx.allocator.available - unheld - self.watermark_blocks
        return min(chunk, spare * self.ctx.block_size) if spare > 0 else 0

    def _evict_newest(self) -> list[Request]:
        """Nothing can run: free the newest request's blocks so older ones can proceed."""
        ctx = self.ctx
        if ctx.paused:
            return ctx.evict_overflow_paused_requests(force_one=True)
        slot = ctx.active[-1]
        reqs = ctx.release_memory_blocks_from_request_indexes([slot])
        for req in reqs:
            req.num_preemptions += 1
        return reqs
