"""Stateful property test: random traffic through the scheduler and the slot table of an engine
core whose model is a stand-in, checked after every rule.

The stand-in has no weights and costs nothing, but it reads what the engine gives it: it writes
each token of the step into the KV buffer (K = token + 1, V = position + 1) and picks the next
token of a sampled row from the row's whole context *as read back through its block table*. So
a block shared by a fork, served by the prefix cache, copied for a fork's partial block, kept by
a paused request or recomputed after an eviction feeds the right tokens or the sampled token is
wrong. The expected tokens come from the same function of the request's own token list.

Rules: add groups from three clients (n > 1 samples fork from their leader; shared prompt starts
hit the prefix cache; a small pool makes requests pause, resume and get evicted), step, abort (a live request or
one already answered), pause / continue the engine in every mode, suspend / resume under every
policy, weight updates under every policy (versions and a prefix-cache reset). Invariants: every
KV block accounted for (free + held + cached == total, ref counts == the slots holding it, a
block held twice only as the same full block of identical tokens), the KV of every slot holds
its tokens, every request's tokens follow from its prompt, every request in exactly one place,
and every request answered once with a finish reason its tokens bear out. Admission is fair: the
waiting queue's lanes hold only their own client's requests that never had a slot, its sample counts
match the live requests, and while a client's first waiting request could start (no prefix-cache
wait for it), no other client gets more than one new group admitted before it.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inference.cache.specs import KVCacheSpec
from inference.config import EvictionPolicy, InferenceConfig, PauseMode, SuspendPolicy, UpdatePolicy
from inference.core.engine_core import EngineCore
from inference.core.states import EngineState
from inference.errors import ContextOverflowError
from inference.kv_cache.hashing import UNSET_HASH
from inference.request import FinishReason, RequestStatus
from inference.sampling.params import SamplingParams

VOCAB, EOS, BLOCK = 40, 2, 4
MAX_LEN = 32  # tokens per request (8 blocks)
_MOD = 1_000_003
# prompt starts that collide across requests (0, 1 and 2 full blocks), so the prefix cache serves them
PREFIXES = [[], [5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22]]
CLIENTS = ["", "a", "b"]  # "": the shared lane of callers without a name
GROUPS = st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(3, VOCAB - 1), max_size=9),
                   st.sampled_from([1, 1, 2, 4]), st.integers(1, 14), st.booleans(), st.booleans(),
                   st.sampled_from(CLIENTS))
RARELY = st.integers(0, 3)  # an engine-wide rule (pause, suspend, weight update) acts only when this draws 0


def _token_of(h: int) -> int:
    return EOS if h % 11 == 0 else 3 + h % (VOCAB - 3)


def next_token(context: list[int]) -> int:
    """The stand-in model: the token after `context`."""
    h = 0
    for t in context:
        h = (h * 31 + t + 1) % _MOD
    return _token_of(h)


def follows(tokens: list[int], start: int) -> bool:
    """Whether every token from `start` on is `next_token` of the tokens before it (one pass)."""
    h = 0
    for k, t in enumerate(tokens):
        if k >= start and t != _token_of(h):
            return False
        h = (h * 31 + t + 1) % _MOD
    return True


class StandIn:
    """A `CausalLM` without maths: one KV layer of one head of width 1 holding token and position."""

    def __init__(self) -> None:
        self.spec = SimpleNamespace(vocab_size=VOCAB, eos_token_ids=frozenset({EOS}), dtype=torch.float32,
                                    weight_shapes=dict)
        self.device = torch.device("cpu")
        self.backend = SimpleNamespace(release_workspace=lambda: 0)

    def cache_specs(self) -> list[KVCacheSpec]:
        return [KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def forward(self, input_ids, positions, kv_cache, meta, logits_indices, *, states=None) -> torch.Tensor:
        n = meta.slot_mapping.shape[0]
        kv_cache.store(0, meta.slot_mapping, (input_ids[:n] + 1).float().view(n, 1, 1),
                       (positions[:n] + 1).float().view(n, 1, 1))
        k, v = kv_cache.layer(0)[0, ..., 0, 0], kv_cache.layer(0)[1, ..., 0, 0]  # [blocks, block_size]
        starts = meta.query_start_loc.tolist()
        picks = []
        for row in logits_indices.tolist():
            r = int(np.searchsorted(starts, row, side="right")) - 1
            p = torch.arange(int(positions[row]) + 1)
            blocks = meta.block_tables[r].long()[p // BLOCK]
            assert torch.equal(v[blocks, p % BLOCK], (p + 1).float()), "the KV read back is not this request's"
            picks.append(next_token((k[blocks, p % BLOCK] - 1).long().tolist()))
        logits = torch.zeros(len(picks), VOCAB)
        logits[torch.arange(len(picks)), torch.tensor(picks, dtype=torch.int64)] = 1.0
        return logits


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(list(EvictionPolicy)), caching=st.booleans(), num_blocks=st.integers(8, 16),
                step_tokens=st.sampled_from([8, 16]), chunk=st.sampled_from([4, 8]))
    def start(self, policy: EvictionPolicy, caching: bool, num_blocks: int, step_tokens: int, chunk: int) -> None:
        # a small pool: one request may need all 8 blocks of MAX_LEN, so requests pause and get evicted
        self.config = InferenceConfig(block_size=BLOCK, num_blocks=num_blocks, max_requests=6,
                                      max_batch_tokens=step_tokens, chunked_prefill_size=chunk,
                                      max_sequence_length=MAX_LEN, eviction_policy=policy,
                                      enable_prefix_caching=caching)
        self.outputs, self.events = [], []
        self.core = EngineCore(StandIn(), self.config, self.outputs.append, self.events.extend)
        self.expected: dict[int, tuple[list[int], SamplingParams, bool]] = {}
        self.answered: dict[int, object] = {}  # request id -> its output
        self.streamed: dict[int, list] = {}  # request id -> its token events so far
        self.may_abort: set[int] = set()  # aborted by a rule, or live when the engine aborted all
        self.client_of: dict[int, str] = {}  # request id -> the client that added it
        self.slotted_groups: set[int] = set()  # groups a sample of which has held a slot
        # per client: (its first waiting request that could start, the new groups of each other
        # client admitted while it waited through whole steps)
        self.overtaken: dict[str, tuple[int, Counter]] = {}
        self.joined_groups: set[int] = set()  # groups that joined another's (see add)

    # ---- rules -------------------------------------------------------------------------------

    @rule(groups=st.lists(GROUPS, min_size=1, max_size=3))
    def add(self, groups) -> None:
        for prefix, tail, n, max_tokens, ignore_eos, stream, client in groups:
            params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
            try:
                prompt, params = self.core.check_request(prefix + tail or [4], params)
            except ContextOverflowError as exc:  # too long for ever, or suspended for now
                assert exc.is_transient == (self.core.state is EngineState.SUSPENDED)
                continue
            for rid in self.core.add_checked(prompt, params, stream_tokens=stream, client=client):
                self.expected[rid] = (prompt, params, stream)
                self.client_of[rid] = client
            # a group that joined a queued leader's (same prompt) is admitted in that leader's turn
            self.joined_groups |= {child.group_id for head in self.core.scheduler.waiting
                                   for child in head.fork_children if child.group_id != head.group_id}

    @rule(times=st.integers(1, 12))
    def step(self, times: int) -> None:
        for _ in range(times):
            heads = self._startable_heads()
            answered = len(self.outputs)
            self.core.step()
            self._check_turns(heads, self._groups_admitted(self.outputs[answered:]))

    def _startable_heads(self) -> dict[str, int]:
        """Per client, the first request of its lane if nothing but room can keep it waiting (no
        wait for a prefill of its prompt start, which the scheduler may let pass its turn)."""
        ctx, waiting = self.core.context, self.core.scheduler.waiting
        heads = {}
        for client in CLIENTS:
            lane = waiting.lane(client)
            if lane and (not ctx.uses_prefix_cache(lane[0]) or not ctx.matchable_hashes(lane[0])):
                heads[client] = lane[0].request_id
        return heads

    def _groups_admitted(self, outputs: list) -> Counter:
        """Per client, the groups that got their first slot in the step just run (some may have
        finished in it already: `outputs`, what it answered)."""
        ctx = self.core.context
        now = {(r.group_id, r.client) for r in (ctx.requests[s] for s in ctx.active + ctx.paused)}
        now |= {(o.group_id, self.client_of[o.request_id]) for o in outputs}
        new = {(g, c) for g, c in now if g not in self.slotted_groups and g not in self.joined_groups}
        self.slotted_groups |= {g for g, _ in new}
        return Counter(c for _, c in new)

    def _check_turns(self, heads: dict[str, int], admitted: Counter) -> None:
        """Round robin: a startable first request that waited through a whole step was overtaken by
        at most one new group of each other client since it became first."""
        if self.core.state is not EngineState.RUNNING:
            self.overtaken.clear()  # NOTE: pause / suspend rules run between steps; start afresh
            return
        waiting = self.core.scheduler.waiting
        for client, rid in heads.items():
            lane = waiting.lane(client)
            if not lane or lane[0].request_id != rid:  # admitted (or aborted) in this step
                self.overtaken.pop(client, None)
                continue
            if self.overtaken.get(client, (None,))[0] != rid:
                self.overtaken[client] = (rid, Counter())
            counts = self.overtaken[client][1]
            counts.update({c: k for c, k in admitted.items() if c != client})
            assert max(counts.values(), default=0) <= 1, f"client {client!r} overtaken: {dict(counts)}"
        for client in set(self.overtaken) - set(heads):
            del self.overtaken[client]

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), rarely=st.integers(0, 1))
    def abort(self, data, rarely: int) -> None:
        if rarely:
            return
        rid = data.draw(st.sampled_from(sorted(self.expected)))
        live = rid in self.core.scheduler.live
        if live:
            self.may_abort.add(rid)
        assert self.core.abort(rid) == live

    @precondition(lambda self: self.core.state is EngineState.RUNNING)
    @rule(mode=st.sampled_from(list(PauseMode)), rarely=RARELY)
    def pause(self, mode: PauseMode, rarely: int) -> None:
        if rarely:
            return
        if mode is PauseMode.ABORT:
            self.may_abort |= set(self.core.scheduler.live)
        self.core.pause(mode)

    @precondition(lambda self: self.core.state is EngineState.PAUSED)
    @rule()
    def continue_(self) -> None:
        self.core.continue_()

    @precondition(lambda self: self.core.state is not EngineState.SUSPENDED)
    @rule(policy=st.sampled_from(list(SuspendPolicy)), rarely=RARELY)
    def suspend(self, policy: SuspendPolicy, rarely: int) -> None:
        if rarely:
            return
        if policy is SuspendPolicy.ABORT:
            self.may_abort |= set(self.core.scheduler.live)
        self.core.suspend(policy)

    @precondition(lambda self: self.core.state is EngineState.SUSPENDED)
    @rule()
    def resume(self) -> None:
        self.core.resume()

    @precondition(lambda self: self.core.state is not EngineState.SUSPENDED)
    @rule(policy=st.sampled_from(list(UpdatePolicy)), rarely=RARELY)
    def update_weights(self, policy: UpdatePolicy, rarely: int) -> None:
        if rarely:
            return
        if policy is UpdatePolicy.ABORT:
            self.may_abort |= set(self.core.scheduler.live)
        self.core.on_weights_updated(policy)

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        ctx, pool = self.core.context, self.core.allocator
        slots = ctx.active + ctx.paused
        assert sorted(ctx.free_slots + slots) == list(range(self.config.max_requests))
        if self.core.state is EngineState.SUSPENDED:  # the buffers are gone; offloaded slots hold no references
            assert pool.free == pool.total and (not slots or ctx.blocks_detached)
            return
        assert not ctx.blocks_detached
        held = Counter()
        where: dict[int, set[tuple[int, tuple[int, ...]]]] = {}
        for slot in slots:
            n = int(ctx.num_blocks[slot])
            assert n * BLOCK >= ctx.kv_len[slot] and n <= self.config.max_blocks_per_request
            for j, block in enumerate(ctx.block_table[slot, :n].tolist()):
                held[block] += 1
                where.setdefault(block, set()).add((j, tuple(ctx.tokens[slot, j * BLOCK:(j + 1) * BLOCK].tolist())))
        refs = pool.state.block_ref_counts.numpy()
        assert refs.tolist() == [held.get(b, 0) for b in range(pool.total)]
        free = set(pool.free_block_ids())
        assert len(free) == pool.free and not free & set(held)
        assert pool.free + pool.active + pool.cached == pool.total and pool.active == len(held)
        hashes = pool.state.block_hashes.numpy()
        assert all(hashes[b] == UNSET_HASH for b in free)
        assert sorted(pool.registry.kv_hash_to_block_id.values()) == np.flatnonzero(hashes != UNSET_HASH).tolist()
        for block, count in held.items():
            if count > 1:  # shared: the same full block of the same tokens in every holder
                (j, tokens), *others = where[block]
                assert not others, f"block {block} held by {count} slots at different places or tokens"
                assert all(ctx.kv_len[s] >= (j + 1) * BLOCK for s in slots if block in
                           ctx.block_table[s, : ctx.num_blocks[s]])

    @invariant()
    def every_slot_holds_its_tokens(self) -> None:
        ctx = self.core.context
        suspended = self.core.state is EngineState.SUSPENDED
        kv = None if suspended else self.core.kv_cache.layer(0)[:, ..., 0, 0]
        for slot, status in [(s, RequestStatus.RUNNING) for s in ctx.active] + [
                (s, RequestStatus.PAUSED) for s in ctx.paused]:
            req = ctx.requests[slot]
            prompt, params, _ = self.expected[req.request_id]
            assert req.status is status
            seq, kv_len, plen = int(ctx.seq_len[slot]), int(ctx.kv_len[slot]), int(ctx.prompt_len[slot])
            tokens = ctx.tokens[slot, :seq].tolist()
            assert plen == len(prompt) and tokens[:plen] == prompt and follows(tokens, plen)
            assert kv_len < seq and seq - plen < params.max_tokens  # a token to feed, not yet finished
            if kv is not None and kv_len:
                p = np.arange(kv_len)
                blocks = ctx.block_table[slot, p // BLOCK]
                assert kv[0, blocks, p % BLOCK].tolist() == [t + 1 for t in tokens[:kv_len]]
                assert kv[1, blocks, p % BLOCK].tolist() == (p + 1).tolist()

    @invariant()
    def every_request_is_in_one_place(self) -> None:
        sched, ctx = self.core.scheduler, self.core.context
        in_slots = [ctx.requests[s] for s in ctx.active + ctx.paused]
        waiting = list(sched.waiting)
        children = [c for head in waiting + in_slots for c in head.fork_children]
        places = Counter(r.request_id for r in waiting + children + in_slots)
        assert all(count == 1 for count in places.values())
        assert set(places) == set(sched.live) == set(self.expected) - set(self.answered)
        assert sched.reserved_slots == sum(len(r.fork_children) for r in in_slots)
        for req in waiting + children:
            assert req.status is RequestStatus.WAITING
            prompt, params, _ = self.expected[req.request_id]
            assert req.prompt_token_ids == prompt and follows(req.all_token_ids, len(prompt))
            assert len(req.generated_token_ids) < params.max_tokens

    @invariant()
    def waiting_is_by_client_and_counted(self) -> None:
        sched = self.core.scheduler
        lanes = sched.waiting.lane_lengths()
        assert all(lanes.values()) and len(sched.waiting) == len(sched.waiting.returning) + sum(lanes.values())
        for client in lanes:
            assert all(r.client == client and not r.admitted for r in sched.waiting.lane(client))
        assert all(self.client_of[r.request_id] == r.client for r in sched.live.values())
        waiting = Counter(r.client for r in sched.live.values() if r.status is RequestStatus.WAITING)
        assert sched.waiting_samples() == dict(waiting) and sched.num_waiting_samples == sum(waiting.values())

    @invariant()
    def every_request_is_answered_once_and_right(self) -> None:
        for event in self.events:  # NOTE: a request's events come before its output
            self.streamed.setdefault(event.request_id, []).append(event)
        self.events.clear()
        for out in self.outputs[len(self.answered):]:
            assert out.request_id not in self.answered, f"request {out.request_id} answered twice"
            self.answered[out.request_id] = out
            self._check_output(out)
        for rid, events in self.streamed.items():  # streamed so far: the tokens the request holds
            assert self.expected[rid][2] and [e.index for e in events] == list(range(len(events)))

    def _check_output(self, out) -> None:
        prompt, params, stream = self.expected[out.request_id]
        gen = out.generated_token_ids
        assert out.prompt_token_ids == prompt and follows(prompt + gen, len(prompt))
        assert len(gen) <= params.max_tokens and len(out.token_versions) == len(gen)
        assert out.token_versions == sorted(out.token_versions)
        assert all(0 <= v <= self.core.policy_version for v in out.token_versions)
        ended_on_eos = bool(gen) and gen[-1] == EOS and not params.ignore_eos
        assert params.ignore_eos or EOS not in gen[:-1]
        if out.finish_reason is FinishReason.STOP:
            assert ended_on_eos
        elif out.finish_reason is FinishReason.LENGTH:
            assert len(gen) == params.max_tokens and not ended_on_eos
        else:
            assert out.finish_reason is FinishReason.ABORT and out.request_id in self.may_abort
            assert len(gen) < params.max_tokens and not ended_on_eos
        events = self.streamed.pop(out.request_id, [])
        if stream:
            assert [(e.index, e.token_id) for e in events] == list(enumerate(gen))
        else:
            assert not events

    def teardown(self) -> None:
        """Whatever state the run ended in, every request added is answered exactly once."""
        core = getattr(self, "core", None)
        if core is None:
            return
        if core.state is EngineState.SUSPENDED:
            core.resume()
        if core.state is EngineState.PAUSED:
            core.continue_()
        idle = 0  # steps in a row that sampled nothing and finished nothing
        while core.has_unfinished_requests():
            before = (core.generated_tokens, len(self.outputs))
            core.step()
            idle = 0 if (core.generated_tokens, len(self.outputs)) != before else idle + 1
            assert idle < 100, f"no progress in {idle} steps: {len(core.scheduler.live)} requests stuck"
        self.every_request_is_answered_once_and_right()
        self.every_request_is_in_one_place()
        assert set(self.answered) == set(self.expected) and not core.has_unfinished_requests()


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
