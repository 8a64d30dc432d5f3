"""Stateful property test of the prefix cache across weight updates: RESET and SALTED policies
(per engine and per request), cache salts, sessions, `max_staleness` under both stale policies,
random interleavings of requests, steps, aborts, pauses, suspends, updates and session ends.

The stand-in model writes ground truth into the KV it computes, on two layers: layer 0 holds the
token (K) and the position plus the policy version of the weights that computed it (V); layer 1
the writer's cache salt (K) and the version its chain is keyed by (V). So what a request reads
is checked against what really computed it, not against the engine's own labels:

* the match rule: every block a request takes from the cache holds K/V of its own salt and key;
  without a version salt (RESET) every position of it was computed by the current weights; with
  one (SALTED) by weights no older than its start version; the block's recorded computing
  version is that of its last position;
* staleness: no live request or session started more than `max_staleness` versions ago, no K/V
  a live request holds is older than its start version, and every answer that is not `stale`
  has no token older than `max_staleness` versions when it finished;
* no leak: free + held + cached == total, ref counts == the slots holding each block, the
  registry == the blocks with a hash;
* collection: a version's blocks are gone past `max_staleness` (SALTED) or, under RESET, unless a
  live salted user keeps them; the cached blocks of versions nobody may match again are the
  first LRU victims (recency 0).
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import torch
from hypothesis import settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inference.cache.specs import KVCacheSpec
from inference.config import (
    EvictionPolicy,
    InferenceConfig,
    PauseMode,
    PrefixCachePolicy,
    StalePolicy,
    SuspendPolicy,
    UpdatePolicy,
)
from inference.core.engine_core import EngineCore
from inference.core.states import EngineState
from inference.errors import ContextOverflowError, StaleSessionError
from inference.kv_cache.hashing import UNSET_HASH
from inference.request import FinishReason
from inference.sampling.params import SamplingParams
from tests.inference.sched.test_scheduler_stateful import BLOCK, EOS, MAX_LEN, VOCAB, follows, next_token

STRIDE = 64  # V of layer 0 = position + 1 + STRIDE * computing version (positions < MAX_LEN < STRIDE)
SALTS = [None, "tenant"]
SESSIONS = [None, "s1", "s2", "s3"]
PREFIXES = [[], [5, 6, 7, 8], [5, 6, 7, 8, 9, 10, 11, 12]]
GROUPS = st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(3, VOCAB - 1), max_size=6),
                   st.sampled_from([1, 1, 2]), st.integers(1, 10), st.booleans(), st.sampled_from(SALTS),
                   st.sampled_from([None, PrefixCachePolicy.RESET, PrefixCachePolicy.SALTED]),
                   st.sampled_from(SESSIONS))


class VersionedStandIn:
    """A `CausalLM` without maths whose K/V record the token, its position, the computing version
    and the writer's key (see module docstring)."""

    def __init__(self) -> None:
        self.spec = SimpleNamespace(vocab_size=VOCAB, eos_token_ids=frozenset({EOS}), dtype=torch.float32,
                                    weight_shapes=dict)
        self.device = torch.device("cpu")
        self.backend = SimpleNamespace(release_workspace=lambda: 0)
        self.core: EngineCore | None = None

    def cache_specs(self) -> list[KVCacheSpec]:
        return [KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=1, dtype=torch.float32)]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def _writer_keys(self, meta) -> list[tuple[float, float]]:
        """(salt tag, key version + 1) of each row's request, found by its block table."""
        ctx = self.core.context
        keys = []
        for r in range(meta.block_tables.shape[0]):
            nb = -(-int(meta.seq_lens[r]) // BLOCK)
            table = meta.block_tables[r, :nb].numpy()
            slots = [s for s in ctx.active + ctx.paused
                     if ctx.num_blocks[s] >= nb and np.array_equal(ctx.block_table[s, :nb], table)]
            assert len(slots) == 1, f"row {r}: {len(slots)} slots own its block table"
            req = ctx.requests[slots[0]]
            keys.append((SALTS.index(req.params.cache_salt) + 1.0, ctx.block_key(req).version + 1.0))
        return keys

    def forward(self, input_ids, positions, kv_cache, meta, logits_indices, *, states=None) -> torch.Tensor:
        n = meta.slot_mapping.shape[0]
        version = self.core.policy_version
        kv_cache.store(0, meta.slot_mapping, (input_ids[:n] + 1).float().view(n, 1, 1),
                       (positions[:n] + 1 + STRIDE * version).float().view(n, 1, 1))
        starts = meta.query_start_loc.tolist()
        tags = torch.zeros(n, 2)
        for r, (salt, key) in enumerate(self._writer_keys(meta)):
            tags[starts[r]:starts[r + 1]] = torch.tensor([salt, key])
        kv_cache.store(1, meta.slot_mapping, tags[:, 0].view(n, 1, 1), tags[:, 1].view(n, 1, 1))
        k, v = kv_cache.layer(0)[0, ..., 0, 0], kv_cache.layer(0)[1, ..., 0, 0]
        picks = []
        for row in logits_indices.tolist():
            r = int(np.searchsorted(starts, row, side="right")) - 1
            p = torch.arange(int(positions[row]) + 1)
            blocks = meta.block_tables[r].long()[p // BLOCK]
            assert torch.equal((v[blocks, p % BLOCK] - 1) % STRIDE, p.float()), "the KV read back is not its own"
            picks.append(next_token((k[blocks, p % BLOCK] - 1).long().tolist()))
        logits = torch.zeros(len(picks), VOCAB)
        logits[torch.arange(len(picks)), torch.tensor(picks, dtype=torch.int64)] = 1.0
        return logits


class SaltedPrefixMachine(RuleBasedStateMachine):
    @initialize(engine_policy=st.sampled_from(list(PrefixCachePolicy)), lru=st.booleans(),
                num_blocks=st.integers(10, 20), staleness=st.sampled_from([None, 0, 1, 2]),
                stale_policy=st.sampled_from(list(StalePolicy)))
    def start(self, engine_policy, lru, num_blocks, staleness, stale_policy) -> None:
        self.config = InferenceConfig(block_size=BLOCK, num_blocks=num_blocks, max_requests=6, max_batch_tokens=16,
                                      chunked_prefill_size=8, max_sequence_length=MAX_LEN,
                                      eviction_policy=EvictionPolicy.LRU if lru else EvictionPolicy.REF_ZERO,
                                      prefix_cache_policy=engine_policy, max_staleness=staleness,
                                      stale_policy=stale_policy, max_sessions=2)
        self.outputs: list = []
        model = VersionedStandIn()
        self.core = EngineCore(model, self.config, self._answered, lambda events: None)
        model.core = self.core
        self.expected: dict[int, tuple[list[int], SamplingParams]] = {}
        self.answered: dict[int, object] = {}
        self.may_abort: set[int] = set()
        self.matched_blocks = 0  # blocks served by the cache, across the run (the rule had work to do)
        ctx = self.core.context
        admit = ctx.add_request

        def add_request_checked(req, chunk):
            out = admit(req, chunk)
            slot = ctx.requests.index(req)
            self._check_matched(req, ctx.block_table[slot, : int(ctx.num_registered[slot])].tolist())
            return out

        ctx.add_request = add_request_checked

    def _answered(self, out) -> None:
        self.outputs.append((out, self.core.policy_version))

    def _kv_truth(self, blocks: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(computing version, salt tag, key version) of every position of `blocks`, from the KV."""
        layers = self.core.kv_cache.data
        v0 = layers[0][1, blocks, :, 0, 0].numpy()
        salt, key = layers[1][0, blocks, :, 0, 0].numpy(), layers[1][1, blocks, :, 0, 0].numpy()
        return ((v0 - 1) // STRIDE).astype(int), salt.astype(int) - 1, key.astype(int) - 1

    def _check_matched(self, req, blocks: list[int]) -> None:
        """THE match rule, against what computed the blocks `req` was just served."""
        if not blocks:
            return
        self.matched_blocks += len(blocks)
        current = self.core.policy_version
        computed, salt, key = self._kv_truth(blocks)
        policy = req.params.prefix_cache_policy or self.config.prefix_cache_policy
        assert req.salted == (policy is PrefixCachePolicy.SALTED)
        assert (salt == SALTS.index(req.params.cache_salt)).all(), "a block of another salt was served"
        if req.salted:
            assert (key == req.start_version).all(), "a block keyed by another version was served"
            assert ((computed >= req.start_version) & (computed <= current)).all()
        else:
            assert (key == current).all() and (computed == current).all(), "a block of older weights was served"
        state = self.core.allocator.state
        assert [state.computed_by(b) for b in blocks] == computed.max(axis=1).tolist()

    # ---- rules -------------------------------------------------------------------------------

    @rule(groups=st.lists(GROUPS, min_size=1, max_size=3), steps=st.integers(0, 4))
    def add(self, groups, steps: int) -> None:
        for prefix, tail, n, max_tokens, ignore_eos, salt, policy, session in groups:
            params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                    cache_salt=salt, prefix_cache_policy=policy, session_id=session)
            try:
                prompt, params = self.core.check_request(prefix + tail or [4], params)
            except StaleSessionError:
                assert session in self.core.scheduler.salts.stale and self.config.stale_policy is StalePolicy.ABORT
                continue
            except ContextOverflowError as exc:
                assert exc.is_transient == (self.core.state is EngineState.SUSPENDED)
                continue
            for rid in self.core.add_checked(prompt, params):
                self.expected[rid] = (prompt, params)
        self.step(steps)  # NOTE: traffic keeps the engine busy: steps come with requests, not only between

    @precondition(lambda self: any(o.generated_token_ids and self.expected[o.request_id][1].session_id
                                   for o in self.answered.values()))
    @rule(data=st.data(), tail=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=3),
          max_tokens=st.integers(1, 6))
    def next_turn(self, data, tail: list[int], max_tokens: int) -> None:
        """An agent's next turn: the last turn's prompt and answer, then new tokens, same session."""
        done = sorted(rid for rid, o in self.answered.items()
                      if o.generated_token_ids and self.expected[rid][1].session_id)
        out = self.answered[data.draw(st.sampled_from(done))]
        params = self.expected[out.request_id][1]
        prompt = (out.prompt_token_ids + out.generated_token_ids + tail)[: MAX_LEN - max_tokens]
        turn = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, cache_salt=params.cache_salt,
                              prefix_cache_policy=params.prefix_cache_policy, session_id=params.session_id)
        try:
            prompt, turn = self.core.check_request(prompt, turn)
        except (StaleSessionError, ContextOverflowError):
            return
        for rid in self.core.add_checked(prompt, turn):
            self.expected[rid] = (prompt, turn)
        self.step(2)

    @rule(times=st.integers(1, 12))
    def step(self, times: int) -> None:
        for _ in range(times):
            self.core.step()

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.expected)))
        if rid in self.core.scheduler.live:
            self.may_abort.add(rid)
        self.core.abort(rid)

    @precondition(lambda self: self.core.state is EngineState.RUNNING)
    @rule(mode=st.sampled_from([PauseMode.KEEP, PauseMode.RETRACT]), rarely=st.integers(0, 3))
    def pause(self, mode: PauseMode, rarely: int) -> None:
        if not rarely:
            self.core.pause(mode)

    @precondition(lambda self: self.core.state is EngineState.PAUSED)
    @rule()
    def continue_(self) -> None:
        self.core.continue_()

    @precondition(lambda self: self.core.state is not EngineState.SUSPENDED)
    @rule(policy=st.sampled_from([SuspendPolicy.RECOMPUTE, SuspendPolicy.OFFLOAD]), rarely=st.integers(0, 3))
    def suspend(self, policy: SuspendPolicy, rarely: int) -> None:
        if not rarely:
            self.core.suspend(policy)

    @precondition(lambda self: self.core.state is EngineState.SUSPENDED)
    @rule()
    def resume(self) -> None:
        self.core.resume()

    @precondition(lambda self: self.core.state is not EngineState.SUSPENDED)
    @rule(policy=st.sampled_from(list(UpdatePolicy)), rarely=st.integers(0, 2))
    def update_weights(self, policy: UpdatePolicy, rarely: int) -> None:
        if rarely:
            return
        live = set(self.core.scheduler.live)
        if policy is UpdatePolicy.ABORT:
            self.may_abort |= live
        self.core.on_weights_updated(policy)

    @rule(session=st.sampled_from(SESSIONS[1:]))
    def end_session(self, session: str) -> None:
        self.core.end_session(session)
        assert session not in self.core.scheduler.salts.stale

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def no_block_is_leaked(self) -> None:
        ctx, pool = self.core.context, self.core.allocator
        slots = ctx.active + ctx.paused
        if self.core.state is EngineState.SUSPENDED:
            assert pool.free == pool.total
            return
        held = Counter(b for s in slots for b in ctx.block_table[s, : ctx.num_blocks[s]].tolist())
        assert pool.state.block_ref_counts.tolist() == [held.get(b, 0) for b in range(pool.total)]
        free = set(pool.free_block_ids())
        assert len(free) == pool.free and not free & set(held)
        assert pool.free + pool.active + pool.cached == pool.total
        hashes = pool.state.block_hashes.numpy()
        assert sorted(pool.registry.kv_hash_to_block_id.values()) == np.flatnonzero(hashes != UNSET_HASH).tolist()

    @invariant()
    def staleness_is_bounded(self) -> None:
        k, core = self.config.max_staleness, self.core
        if core.state is EngineState.SUSPENDED:
            return
        ctx, current = core.context, core.policy_version
        for slot in ctx.active + ctx.paused:  # the K/V a request holds is never older than its start
            req, kv_len = ctx.requests[slot], int(ctx.kv_len[slot])
            if kv_len:
                p = np.arange(kv_len)
                computed = self._kv_truth(ctx.block_table[slot, p // BLOCK].tolist())[0][np.arange(kv_len), p % BLOCK]
                assert (computed >= req.start_version).all()
        if k is None:
            return
        assert all(r.start_version >= current - k for r in core.scheduler.live.values())
        assert all(v >= current - k for v in core.scheduler.salts.live_versions())

    @invariant()
    def old_versions_are_collected(self) -> None:
        core = self.core
        if core.state is EngineState.SUSPENDED:
            return
        pool, current, k = core.allocator, core.policy_version, self.config.max_staleness
        live = core.scheduler.salts.live_versions()
        versions = set(pool.blocks_by_version())
        if self.config.prefix_cache_policy is PrefixCachePolicy.SALTED and k is not None:
            assert all(v >= current - k for v in versions), f"blocks of {versions} past max_staleness={k}"
        state = pool.state
        for block in state.registered_ids(versions - live - {current}):
            if state.is_lru and state.ref_count(block) == 0:  # nobody may match it again: the first to go
                assert state.block_timestamps[block] == 0, f"block {block} of an unused version is not first to go"

    @invariant()
    def answers_are_right(self) -> None:
        k = self.config.max_staleness
        for out, version in self.outputs[len(self.answered):]:
            assert out.request_id not in self.answered
            self.answered[out.request_id] = out
            prompt, params = self.expected[out.request_id]
            gen = out.generated_token_ids
            assert out.prompt_token_ids == prompt and follows(prompt + gen, len(prompt))
            assert len(out.token_versions) == len(gen) and out.token_versions == sorted(out.token_versions)
            if out.finish_reason is FinishReason.STALE:
                assert k is not None
                continue
            if out.finish_reason is FinishReason.ABORT:
                assert out.request_id in self.may_abort
            if k is not None and gen:
                assert out.token_versions[0] >= version - k, "an answer spans more than max_staleness versions"

    def teardown(self) -> None:
        core = getattr(self, "core", None)
        if core is None:
            return
        if core.state is EngineState.SUSPENDED:
            core.resume()
        if core.state is EngineState.PAUSED:
            core.continue_()
        for _ in range(2000):
            if not core.has_unfinished_requests():
                break
            core.step()
        self.answers_are_right()
        assert set(self.answered) == set(self.expected), "a request was never answered"
        target(float(self.matched_blocks), label="blocks served by the cache")  # NOTE: steer to runs the rule acts in


TestSaltedPrefix = SaltedPrefixMachine.TestCase
TestSaltedPrefix.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
