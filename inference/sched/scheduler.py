"""Decides, each step, which requests run and how many tokens each computes.

Order of business (oldest work first, so nothing starves):
1. resume paused requests, oldest first, while a block can be had for each;
2. decode-ready requests get the block their next token needs, or are paused;
3. paused requests past their block budget are evicted (to be recomputed later);
4. the token budget left after decode goes to running prefills, then to waiting requests, the
   clients taking turns (`WaitingQueue`: one request per client per turn, FIFO within a client),
   each chunk at most `chunked_prefill_size` tokens and only as many as free blocks allow.
If nothing at all can run while requests hold the pool, the newest one is evicted: progress is
guaranteed as long as one request fits the pool, which admission checks.

The scheduler is the sole owner of a request's life outside its slot: the live requests, the
waiting queue, the samples of a group waiting to fork from their leader, the slots reserved for
them, the count of samples waiting per client, preemption counts, and what abort / requeue do to
all of these.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from inference.errors import BlockOverflowError
from inference.kv_cache.block_state import MAX_CACHED_PROMPT_TOP_N_LOGPROBS
from inference.kv_cache.policy import PrefixCachePolicy
from inference.request import FinishReason, Request, RequestStatus
from inference.sched.context import DynamicInferenceContext
from inference.sched.forks import GroupForks
from inference.sched.salts import SaltBook
from inference.sched.waiting import WaitingQueue


@dataclass(slots=True)
class StepPlan:
    """The requests of one step: `slots[i]` computes `query_lens[i]` tokens; decodes come first.
    `verify`: a speculative step (decodes with their proposed tokens), sampled at every token."""

    slots: np.ndarray
    query_lens: np.ndarray
    num_decode: int
    evicted: list[Request] = field(default_factory=list)
    verify: bool = False

    @property
    def empty(self) -> bool:
        return self.slots.size == 0


ADMISSION_SCAN = 256  # waiting requests looked at per step (bounds the scheduler's per-step work)
# the largest group (a share of the engine's slots) that later requests may join: a group is
# admitted only when its whole size of slots is free, so a big one waits while the slots turn over
MAX_JOINED_SHARE = 0.5


def _prefill_key(req: Request) -> tuple:
    """What two requests must share for one to fork from the other's prefill: the client (turns
    between clients stay fair), the prompt, and everything the prompt's KV, its log-probs or its
    routes depend on (adapter and its pinned version, salts, session, start version)."""
    p = req.params
    return (req.client, tuple(req.prompt_token_ids), None if req.lora is None else req.lora.id, req.start_version,
            req.salted, p.cache_salt, p.session_id, p.prompt_logprobs, p.return_routed_experts)


def _scores_wanted(req: Request) -> int:
    """The top-n of prompt scores a request needs from cached blocks (-1: none)."""
    return -1 if req.params.prompt_logprobs is None else req.params.prompt_logprobs


def _scores_recorded(req: Request) -> int:
    """The top-n of the prompt scores a request caches with the blocks it registers (-1: none)."""
    scores = req.prompt_scores
    return -1 if scores is None or scores.top_n > MAX_CACHED_PROMPT_TOP_N_LOGPROBS else scores.top_n


class Scheduler(GroupForks):
    """Admits, pauses, resumes, evicts, aborts and forks requests through the context.

    Invariants: every live request is exactly one of waiting (in `waiting`, or a sibling in its
    leader's `fork_children`), in a slot (running or paused), or finished and gone from `live`;
    `reserved_slots` equals the fork children of the leaders that hold a slot; `waiting_samples`
    counts, per client, the live requests with status WAITING (the two kinds of waiting above).
    """

    def __init__(self, context: DynamicInferenceContext) -> None:
        self.ctx = context
        self.config = context.config
        self.waiting = WaitingQueue()
        self.live: dict[int, Request] = {}  # every request not finished yet, by id
        self._waiting_samples: Counter[str] = Counter()  # per client: live requests not in a slot
        self._num_waiting_samples = 0  # their sum (what the queue's bound is checked against)
        self._reserved_slots = 0  # slots promised to forked samples of groups being prefilled
        self.num_preemptions = 0
        self.salts = SaltBook(self.config.max_sessions)  # live users of each salted version
        self.watermark_blocks = max(1, context.allocator.total // 100)
        self._ids = itertools.count()
        self._groups = itertools.count()
        self._open_prefills: dict[tuple, Request] = {}  # queued leaders by `_prefill_key` (see new_group)

    @property
    def reserved_slots(self) -> int:
        return self._reserved_slots

    @property
    def num_waiting_samples(self) -> int:
        """Samples not in a slot: queued, or waiting to fork from their group's leader."""
        return self._num_waiting_samples

    def waiting_samples(self) -> dict[str, int]:
        """`num_waiting_samples` per client (only clients with some)."""
        return dict(self._waiting_samples)

    def _count_waiting(self, client: str, k: int) -> None:
        """`k` of the client's samples started (> 0) or stopped (< 0) waiting."""
        left = self._waiting_samples[client] + k
        if left:
            self._waiting_samples[client] = left
        else:
            del self._waiting_samples[client]
        self._num_waiting_samples += k

    # ---- a request's life --------------------------------------------------------------------

    def new_group(self, samples: list[Request]) -> None:
        """Queue the n samples of one prompt: the first prefills it, the others fork from it.

        A group whose prompt a queued leader already has (same client, same tokens, same KV keys:
        `_prefill_key`) joins that leader's group instead: RL callers that send a prompt's n samples
        as n requests get one prefill, as `n` would give them, not n prefills of its partial last block.
        """
        head = samples[0]
        self._salt(samples)
        for req in samples:
            self.live[req.request_id] = req
        self._count_waiting(head.client, len(samples))
        key = _prefill_key(head)
        leader = self._open_prefills.get(key)
        if leader is not None and self._may_join(leader, len(samples)):
            leader.fork_children.extend(samples)
            return
        head.fork_children = samples[1:]
        head.prefill_key = key
        self._open_prefills[key] = head
        self._queue(head)

    def _may_join(self, leader: Request, samples: int) -> bool:
        """Whether `samples` more may fork from `leader`: it still waits for its first slot, and the
        group stays small enough (`MAX_JOINED_SHARE` of the slots) not to wait long for free ones."""
        limit = max(1, int(self.config.max_requests * MAX_JOINED_SHARE))
        return (leader.status is RequestStatus.WAITING and not leader.admitted and leader.request_id in self.live
                and 1 + len(leader.fork_children) + samples <= limit)

    def _close_prefill(self, req: Request) -> None:
        """`req` leaves the queue (admitted, finished, restarted): no later request joins it."""
        key, req.prefill_key = req.prefill_key, None
        if key is not None and self._open_prefills.get(key) is req:
            del self._open_prefills[key]

    def _salt(self, samples: list[Request]) -> None:
        """The group's start version (its session's if the session is known) and whether its blocks
        are keyed by it (the SALTED prefix-cache policy)."""
        params, current = samples[0].params, self.ctx.policy_version
        policy = params.prefix_cache_policy or self.config.prefix_cache_policy
        salted = policy is PrefixCachePolicy.SALTED and self.ctx.allocator.enable_prefix_caching
        start = current
        if params.session_id is not None:
            known = self.salts.session_version(params.session_id)
            if known is None:
                unused = set(self.salts.start_session(params.session_id, current, salted)) - {current}
                self.ctx.allocator.demote_key_versions(unused)  # sessions the LRU bound dropped
            else:
                start = known
        for req in samples:
            req.start_version, req.salted = start, salted
            if salted:
                self.salts.acquire(start)

    def set_start_version(self, req: Request, version: int) -> None:
        """`req` starts again under `version` (a stale one restarted): its salt moves with it."""
        self._close_prefill(req)
        if req.salted:
            self._release_salt(req)
            self.salts.acquire(version)
        req.start_version = version

    def _release_salt(self, req: Request) -> None:
        unused = self.salts.release(req.start_version)
        if unused is not None and unused != self.ctx.policy_version:
            self.ctx.allocator.demote_key_versions({unused})

    def end_session(self, session_id: str) -> bool:
        """Forget a session (its trajectory is over): its version's blocks go first once unused."""
        known = self.salts.session_version(session_id) is not None
        unused = self.salts.end_session(session_id)
        if unused is not None and unused != self.ctx.policy_version:
            self.ctx.allocator.demote_key_versions({unused})
        return known

    def next_ids(self, n: int) -> tuple[int, list[int]]:
        """A fresh group id and `n` fresh request ids."""
        return next(self._groups), [next(self._ids) for _ in range(n)]

    def _queue(self, req: Request, front: bool = False) -> None:
        """Queue a new request last in its client's lane, or (`front`) one put back first in the
        returning lane."""
        if req.status is not RequestStatus.WAITING:  # back from a slot
            self._count_waiting(req.client, 1)
        req.status = RequestStatus.WAITING
        (self.waiting.push_returning if front else self.waiting.push)(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        self._close_prefill(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        if self.live.pop(req.request_id, None) is not None and req.salted:
            self._release_salt(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def in_flight(self) -> bool:
        """Whether a request that has held a slot is unfinished (what a WAIT pause drains)."""
        # NOTE: one that held a slot and waits again is in the returning lane (the clients' hold new ones only)
        return bool(self.ctx.active or self.ctx.paused) or any(r.admitted for r in self.waiting.returning)

    def abort(self, request_id: int, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """Finish one request now with reason `abort` (or `reason`; partial tokens kept); None if unknown."""
        req = self.live.get(request_id)
        if req is None:
            return None
        ctx = self.ctx
        if req.status is RequestStatus.WAITING:
            self._count_waiting(req.client, -1)
            if req in self.waiting:  # NOTE: the next sibling takes its place in line
                self.waiting.replace(req, self._next_leader(req))
            else:  # a sibling waiting for its group's prefill
                in_slots = (r for r in ctx.requests if r is not None)
                for head in itertools.chain(self.waiting, in_slots):
                    if req in head.fork_children:
                        head.fork_children.remove(req)
                        if head.status is not RequestStatus.WAITING:
                            self._reserved_slots -= 1
                        break
        else:
            ctx.release_memory_blocks_from_request_indexes([ctx.requests.index(req)])
            self._reserved_slots -= len(req.fork_children)
            lead = self._next_leader(req)
            if lead is not None:  # NOTE: the group was admitted: it goes on first
                self._queue(lead, front=True)
        self.finish(req, reason)
        return req

    @staticmethod
    def _next_leader(leader: Request) -> Request | None:
        """The leader leaves before its group forked: the next sibling (returned, if any) takes the
        rest of the group and prefills for them."""
        if not leader.fork_children:
            return None
        lead, rest = leader.fork_children[0], leader.fork_children[1:]
        lead.fork_children, leader.fork_children = rest, []
        return lead

    def abort_all(self) -> list[Request]:
        """Finish every live request with reason `abort`, oldest first; frees all their blocks."""
        ctx = self.ctx
        ctx.release_memory_blocks_from_request_indexes(list(ctx.active) + list(ctx.paused))
        self.waiting.clear()
        self._waiting_samples.clear()
        self._num_waiting_samples = 0
        self._reserved_slots = 0
        self._open_prefills.clear()
        aborted = sorted(self.live.values(), key=lambda r: r.request_id)
        for req in aborted:
            req.fork_children = []
            self.finish(req, FinishReason.ABORT)
        return aborted

    def requeue_in_slot_requests(self) -> int:
        """Release every request in a slot and queue it at the front, oldest first, to be
        recomputed from its tokens (suspend RECOMPUTE, pause RETRACT, update RECOMPUTE)."""
        ctx = self.ctx
        slots = sorted(ctx.active + ctx.paused, key=lambda s: ctx.requests[s].request_id)
        requests = ctx.release_memory_blocks_from_request_indexes(slots)
        for req in reversed(requests):
            self.requeue_released(req)
        return len(requests)

    def requeue_released(self, req: Request) -> None:
        """A request just released from its slot goes back first in line, to be recomputed."""
        self._reserved_slots -= len(req.fork_children)  # re-reserved when it is admitted again
        self._queue(req, front=True)

    # ---- each step ---------------------------------------------------------------------------

    def schedule(self, admit_new: bool = True) -> StepPlan:
        """This step's requests. `admit_new=False` (a WAIT pause) admits only requests that have
        held a slot before (evicted ones), so what is in flight can finish."""
        ctx = self.ctx
        evicted: list[Request] = []
        ctx.resume_paused_requests()
        active = np.array(ctx.active, dtype=np.int64)
        decode, changed = self._schedule_decodes(evicted, active)
        overflow = ctx.evict_overflow_paused_requests()
        if overflow:  # NOTE: the blocks they freed resumed older paused ones: those decode now, else this
            evicted += overflow  # step would run nothing and evict them too (two requests could livelock)
            decode, changed = self._schedule_decodes(evicted, np.array(ctx.active, dtype=np.int64))
        if changed or overflow:  # NOTE: requests paused or evicted: the active ones are others
            active = np.array(ctx.active, dtype=np.int64)
        budget = self.config.max_batch_tokens - decode.size
        prefill_slots, prefill_lens = self._schedule_prefills(budget, admit_new, active)
        if not decode.size and not prefill_slots and ctx.has_unfinished_requests():
            evicted += self._evict_newest()
        for req in reversed(evicted):
            req.num_preemptions += 1
            self.num_preemptions += 1
            self._reserved_slots -= len(req.fork_children)  # re-reserved when it is admitted again
            self._queue(req, front=True)
        if not prefill_slots:
            return StepPlan(decode, np.ones(decode.size, dtype=np.int64), decode.size, evicted)
        slots = np.concatenate((decode, np.array(prefill_slots, dtype=np.int64)))
        lens = np.ones(slots.size, dtype=np.int64)
        lens[decode.size :] = prefill_lens
        return StepPlan(slots, lens, decode.size, evicted)

    def _schedule_decodes(self, evicted: list[Request], active: np.ndarray) -> tuple[np.ndarray, bool]:
        """Decode-ready slots of `active` that have the block of their next token, and whether any
        request was paused (the others) or evicted on the way. Prefills evicted to make room for an
        older decode are appended to `evicted`."""
        ctx = self.ctx
        ready = active[ctx.kv_len[active] == ctx.seq_len[active] - 1]
        needs_block = ready[ctx.kv_len[ready] // ctx.block_size >= ctx.num_blocks[ready]]
        if needs_block.size == 0 or ctx.grow_each_by_one(needs_block):
            return ready, False
        paused = set()
        evicted_before = len(evicted)
        for slot in needs_block.tolist():
            while not ctx.grow(slot, int(ctx.kv_len[slot]) + 1):
                # NOTE: a newer request's prefill yields to an older one's next token (else they can livelock)
                newer = [s for s in ctx.active[ctx.active.index(slot) + 1:] if ctx.seq_len[s] - ctx.kv_len[s] > 1]
                if not newer:
                    ctx.pause(slot)
                    paused.add(slot)
                    break
                evicted += ctx.release_memory_blocks_from_request_indexes([newer[-1]])
        kept = np.array([s for s in ready.tolist() if s not in paused], dtype=np.int64)
        return kept, bool(paused) or len(evicted) > evicted_before

    def _schedule_prefills(self, budget: int, admit_new: bool, active: np.ndarray) -> tuple[list[int], list[int]]:
        ctx, chunk_cap = self.ctx, self.config.chunked_prefill_size
        slots: list[int] = []
        lens: list[int] = []
        prefilling = active[ctx.seq_len[active] - ctx.kv_len[active] > 1]
        for slot in prefilling.tolist():  # NOTE: decode-ready slots (one token left) run as decodes
            if budget <= 0:
                break
            todo = int(ctx.seq_len[slot] - ctx.kv_len[slot])
            chunk = self._fit_chunk(slot, ctx.cut_chunk(slot, min(todo, chunk_cap, budget)))
            if chunk > 0:
                slots.append(slot)
                lens.append(chunk)
                budget -= chunk
        self._admit_waiting(budget, admit_new, prefilling, slots, lens)
        return slots, lens

    def _admit_waiting(self, budget: int, admit_new: bool, prefilling: np.ndarray, slots: list[int],
                       lens: list[int]) -> None:
        """Admit waiting requests into free slots, appending their first chunks to `slots` and
        `lens`: the returning lane first, in order, then the clients in turns (each turn admits the
        first request of the client's lane that may run now). Stops at the first request that does
        not fit: it stays first (its client keeps its turn), so a large group is not overtaken for
        ever by smaller requests."""
        ctx, waiting = self.ctx, self.waiting
        if len(ctx.free_slots) <= self.reserved_slots:  # NOTE: the steady state under load: no request can start
            return
        being_prefilled = self._first_blocks_being_prefilled(prefilling)
        passed = 0  # requests looked at and left waiting (bounds the scan)
        returning, index = waiting.returning, 0
        while index < len(returning) and passed < ADMISSION_SCAN and budget > 0 and not ctx.paused:
            req = returning[index]
            if not self._may_start(req, admit_new, being_prefilled):
                index += 1
                passed += 1
                continue
            budget = self._admit(req, budget, being_prefilled, slots, lens)
            if budget is None:
                return
            waiting.take_returning(index)
        if not admit_new:  # NOTE: the clients' lanes hold only requests that never had a slot
            return
        turns = deque(waiting.clients_in_turn(ADMISSION_SCAN))  # NOTE: O(clients) per step, at most the scan
        scanned = dict.fromkeys(turns, 0)  # per client: its lane's requests left waiting this step
        while turns and passed < ADMISSION_SCAN and budget > 0 and not ctx.paused:
            client = turns[0]
            lane, index = waiting.lane(client), scanned[client]
            if index >= len(lane):  # nothing of this client may start this step: its turn passes
                turns.popleft()
                continue
            req = lane[index]
            if not self._may_start(req, admit_new, being_prefilled):
                scanned[client] += 1
                passed += 1
                continue
            budget = self._admit(req, budget, being_prefilled, slots, lens)
            if budget is None:
                return
            waiting.take(client, index)  # NOTE: its turn is over: it goes last, here as in the queue
            if waiting.lane(client):
                turns.rotate(-1)
            else:
                turns.popleft()

    def _may_start(self, req: Request, admit_new: bool, being_prefilled: dict[int, int]) -> bool:
        """Whether a waiting request may be admitted this step (else it is passed over, keeping its place)."""
        if not (admit_new or req.admitted):
            return False
        first = self._first_block_hash(req)
        # NOTE: the same prompt start is being prefilled right now (with the prompt scores this
        # request asks for, if any): wait a step and match its blocks from the cache instead of
        # computing them again (n=1 GRPO samples)
        return first is None or being_prefilled.get(first, -2) < _scores_wanted(req)

    def _admit(self, req: Request, budget: int, being_prefilled: dict[int, int], slots: list[int],
               lens: list[int]) -> int | None:
        """Give `req` a slot and its first chunk (the caller takes it out of the queue); the token
        budget left, or None (nothing changed) when its group's slots or its blocks cannot be had."""
        ctx = self.ctx
        group = 1 + len(req.fork_children)
        if len(ctx.free_slots) - self.reserved_slots < group:
            return None
        chunk = min(self.config.chunked_prefill_size, budget)
        _, _, fits = ctx.check_availability(req, chunk)
        if not fits:
            chunk = self._chunk_within_free_blocks(req, chunk)
            if chunk <= 0:
                return None
        try:
            slot_chunk = ctx.add_request(req, chunk)
        except BlockOverflowError:
            return None  # NOTE: nothing changed; it stays in line
        req.admitted = True
        self._close_prefill(req)
        self._count_waiting(req.client, -1)
        self._reserved_slots += group - 1
        slot = ctx.active[-1]
        first = self._first_block_hash(req)
        if first is not None and ctx.num_registered[slot] < len(req.hash_cache):
            being_prefilled[first] = max(being_prefilled.get(first, -1), _scores_recorded(req))
        if slot_chunk > 0:
            slots.append(slot)
            lens.append(slot_chunk)
            budget -= slot_chunk
        return budget

    def _first_block_hash(self, req: Request) -> int | None:
        """Hash of the request's first full block when it can share blocks through the cache."""
        if not self.ctx.uses_prefix_cache(req):
            return None
        hashes = self.ctx.matchable_hashes(req)
        return hashes[0] if hashes else None

    def _first_blocks_being_prefilled(self, prefilling: np.ndarray) -> dict[int, int]:
        """First-block hashes of the running prefills that will register new full blocks, each
        with the top-n of the prompt scores cached with them (-1: none)."""
        ctx = self.ctx
        heads: dict[int, int] = {}
        for slot in prefilling.tolist():
            req = ctx.requests[slot]
            if not ctx.cache_broken[slot] and req.hash_cache and ctx.num_registered[slot] < len(req.hash_cache):
                first = req.hash_cache[0]
                heads[first] = max(heads.get(first, -1), _scores_recorded(req))
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
        return ctx.release_memory_blocks_from_request_indexes([ctx.active[-1]])
