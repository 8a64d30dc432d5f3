"""A speculative decode step: propose tokens per request, verify them all in one forward.

Taken only for a decode-only step of at most `SpeculativeConfig.max_rows` requests (the tail of a
batch, where a step is mostly fixed cost); a larger batch, or one where nothing is proposed,
decodes as usual. For each request the step feeds its last token plus `d` proposed tokens (their
K/V written into its blocks), samples the target at all `d + 1` positions and keeps the leading
samples that confirm the proposals, plus the one sample after them (see speculation/verify.py).

Reproducibility: a seeded request's generator gives one uniform per sampled position, in order
(the sampler draws them row by row). Before the verify its state is saved; after it, the state is
restored and advanced by the tokens kept, so position p always gets the p-th uniform, with
speculation or without. Unseeded rows draw fresh uniforms per position: the same distribution.

Rollback: `kv_len` advances only over the kept tokens (the K/V past them is stale and will be
overwritten), blocks taken for rejected positions go back to the pool, and only blocks of kept
tokens are registered in the prefix cache. A model with recurrent state (hybrid Mamba) leaves its
state rows untouched by the verify forward and then moves them over the kept tokens only
(`ModelRunner.advance_states`, see models/hybrid/verify.py), before any request finishes.

Refused per request (counted in the engine's stats, by reason): its own opt-out
(`SamplingParams.speculative=False`), logit processors (penalties,
min_tokens, bias, bad words, allowed ids) and structured outputs, whose masks depend on every
token before the position; MoE routing replay (`return_routed_experts`). Such a request decodes
one token per step, in a speculative step or not.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch

from inference.config import SpeculativeConfig
from inference.core import outputs as out_ops
from inference.sampling.sampler import SamplerOutput
from inference.sched.block_registration import register_full_blocks
from inference.sched.scheduler import StepPlan
from inference.speculation.history import PromptHistory
from inference.speculation.proposer import build_corpus, propose
from inference.speculation.verify import accepted_counts, cut_at_stops

# A request's per-token acceptance estimate: (hits + PRIOR_WEIGHT * PRIOR) / (trials + PRIOR_WEIGHT),
# its evidence fading by EVIDENCE_DECAY per step it decodes, so a request that stopped proposing
# tries again once its failures are old.
PRIOR, PRIOR_WEIGHT, EVIDENCE_DECAY = 0.5, 2.0, 0.9


class SpeculativeSteps:
    """Proposals and verify steps of one `EngineCore` (see module docstring). `core` is not
    imported here: the core imports this module.

    Per request, the draft length follows its acceptance so far: with per-token acceptance
    estimate a, the j-th proposed token is kept with probability about a^j, so it is proposed only
    while a^j >= `SpeculativeConfig.min_acceptance` (a cost model: below it, the extra rows of the
    forward and the sampler cost more than the tokens they are expected to save).

    Invariant: per slot, `owner` is the request id the estimate belongs to; a slot taken by another
    request starts afresh.
    """

    def __init__(self, core: Any, config: SpeculativeConfig) -> None:
        self.core = core
        self.config = config
        self.history = PromptHistory(config.history_samples, config.history_prompts)
        n = core.config.max_requests
        self._owner = np.full(n, -1, dtype=np.int64)
        self._hits = np.zeros(n, dtype=np.float64)  # proposed tokens kept (fading evidence)
        self._trials = np.zeros(n, dtype=np.float64)  # proposed tokens tested (up to the first rejection)
        self._refused = np.zeros(n, dtype=bool)
        self._prompt_key: list[tuple[int, ...] | None] = [None] * n
        self.steps = self.rows = self.proposed = self.accepted = self.emitted = 0
        self.refused: Counter[str] = Counter()

    # ---- the step ----------------------------------------------------------------------------

    def try_step(self, plan: StepPlan) -> bool:
        """Run `plan` as a verify step if it is a small decode-only step with proposals; False
        (nothing changed) when the caller should run it as usual."""
        if plan.num_decode != plan.slots.size or plan.slots.size > self.config.max_rows:
            return False
        if self._forks_pending(plan.slots):
            return False
        drafts = self._propose(plan.slots)
        if drafts is None:
            return False
        self._verify(plan, drafts)
        return True

    def _forks_pending(self, slots: np.ndarray) -> bool:
        """Whether a group leader samples its first token this step: its samples fork from it in
        the plain step (`Scheduler.fork_groups`), never in a verify one. NOTE: a prompt whose last
        chunk is one token (chunk boundaries, a cached prefix) decodes it, so this does happen."""
        ctx = self.core.context
        first = slots[ctx.seq_len[slots] == ctx.prompt_len[slots]]
        return any(ctx.requests[slot].fork_children for slot in first.tolist())

    def _propose(self, slots: np.ndarray) -> list[np.ndarray] | None:
        """Each slot's proposed tokens with their blocks taken, or None when none has any."""
        ctx, cfg = self.core.context, self.config
        groups: dict[int, list[int]] = {}
        for slot in slots.tolist():
            groups.setdefault(ctx.requests[slot].group_id, []).append(slot)
        watermark = self.core.scheduler.watermark_blocks
        self._hits[slots] *= EVIDENCE_DECAY
        self._trials[slots] *= EVIDENCE_DECAY
        lengths = self._draft_lengths(slots)
        drafts: list[np.ndarray] = []
        empty = np.empty(0, dtype=np.int64)
        # NOTE: the step's input buffers hold no more than max_batch_tokens
        budget = min(self.core.config.max_batch_tokens, cfg.max_step_tokens) - slots.size
        for slot, length in zip(slots.tolist(), lengths.tolist()):
            room = min(length, int(ctx.max_len[slot] - ctx.seq_len[slot]) - 1, budget)
            if room < 1 or not self._may_propose(slot):
                drafts.append(empty)
                continue
            seq_len = int(ctx.seq_len[slot])
            seq = ctx.tokens[slot, :seq_len]
            siblings = [ctx.tokens[s, ctx.prompt_len[s] : ctx.seq_len[s]] for s in groups[ctx.requests[slot].group_id]
                        if s != slot]
            corpus = build_corpus(self.history.of(self._prompt_key[slot]) + siblings + [seq])
            draft = propose(seq[-cfg.max_match :], corpus, room, cfg.min_match, cfg.max_match)
            kv_end = int(ctx.kv_len[slot]) + 1 + draft.size
            if draft.size and (ctx.allocator.available - ctx.blocks_needed(slot, kv_end) < watermark
                               or not ctx.grow(slot, kv_end)):
                draft = empty
            if draft.size:
                ctx.tokens[slot, seq_len : seq_len + draft.size] = draft  # NOTE: past seq_len: scratch until kept
                budget -= draft.size
            drafts.append(draft)
        return drafts if any(d.size for d in drafts) else None

    def _draft_lengths(self, slots: np.ndarray) -> np.ndarray:
        """Tokens to propose per slot: the largest j with a^j >= min_acceptance (see class docstring)."""
        cfg = self.config
        alpha = (self._hits[slots] + PRIOR_WEIGHT * PRIOR) / (self._trials[slots] + PRIOR_WEIGHT)
        with np.errstate(divide="ignore"):
            j = np.floor(np.log(cfg.min_acceptance) / np.log(np.minimum(alpha, 1 - 1e-9)))
        return np.clip(j, 0, cfg.num_tokens).astype(np.int64)

    def _may_propose(self, slot: int) -> bool:
        """Whether the slot's request may speculate at all (counts a refusal once per admission)."""
        ctx = self.core.context
        req = ctx.requests[slot]
        if self._owner[slot] != req.request_id:
            self._owner[slot] = req.request_id
            self._hits[slot] = self._trials[slot] = 0.0
            self._prompt_key[slot] = tuple(req.prompt_token_ids)
            reason = self._refusal(slot)
            self._refused[slot] = reason is not None
            if reason is not None:
                self.refused[reason] += 1
        return not self._refused[slot]

    def _refusal(self, slot: int) -> str | None:
        ctx = self.core.context
        if not ctx.requests[slot].params.speculative:
            return "opted_out"
        if ctx.processors.uses[slot]:
            return "logit_processors"
        if ctx.grammars.uses[slot]:
            return "structured_outputs"
        if ctx.returns_routes[slot]:
            return "routed_experts"
        return None

    def _verify(self, plan: StepPlan, drafts: list[np.ndarray]) -> None:
        core, ctx = self.core, self.core.context
        slots = plan.slots
        lens = np.array([d.size for d in drafts], dtype=np.int64)
        query = lens + 1
        starts = np.cumsum(query) - query
        vplan = StepPlan(slots, query, 0, plan.evicted, verify=True)
        batch = core.runner.prepare_verify(ctx, vplan)
        try:
            logits = core.runner.forward(batch, eager=True)
        except Exception:
            ctx.allocator.events.discard_pending()
            raise
        core.count_step()
        row_slots = np.repeat(slots, query)
        seeded = {int(s): ctx.generators[s].get_state() for s in slots[lens > 0].tolist()
                  if ctx.generators[s] is not None}
        out = core.runner.sample(logits[: row_slots.size], out_ops.sampling_batch(ctx, row_slots))
        sampled = out.token_ids.numpy()
        is_stop = np.isin(sampled, core.eos_token_ids) & ~ctx.ignore_eos[row_slots]
        is_stop |= (ctx.stop_ids[row_slots] == sampled[:, None]).any(axis=1)
        accepted = accepted_counts(sampled, drafts, starts)
        kept = cut_at_stops(accepted + 1, is_stop, starts)
        if batch.verify is not None:  # NOTE: before commit_tokens may finish a request and free its row
            core.runner.advance_states(batch, kept)
        for slot, state in seeded.items():  # position p keeps its p-th uniform (module docstring)
            gen = ctx.generators[slot]
            gen.set_state(state)
            b = int(np.flatnonzero(slots == slot)[0])
            torch.rand(int(kept[b]), dtype=torch.float64, generator=gen, device=gen.device)
        ctx.kv_len[slots] += kept
        self._roll_back_blocks(slots)
        register_full_blocks(ctx, slots)  # NOTE: kv_len covers kept tokens only
        ctx.allocator.events.publish_pending()
        self._account(slots, lens, accepted)
        for j in range(int(kept.max())):  # column j: the j-th kept token of every request that has one
            has = kept > j
            rows = torch.from_numpy(starts[has] + j)
            col = SamplerOutput(out.token_ids[rows], out.logprobs[rows],
                                None if out.top_logprobs is None else out.top_logprobs[rows],
                                None if out.top_token_ids is None else out.top_token_ids[rows])
            core.commit_tokens(slots[has], col)

    def _roll_back_blocks(self, slots: np.ndarray) -> None:
        """Give back the blocks taken for rejected positions (past the next token's block)."""
        ctx = self.core.context
        keep = -(-(ctx.kv_len[slots] + 1) // ctx.block_size)
        for slot, blocks in zip(slots.tolist(), keep.tolist()):
            have = int(ctx.num_blocks[slot])
            if have > blocks:
                ctx.allocator.release(ctx.block_table[slot, blocks:have].tolist())
                ctx.num_blocks[slot] = blocks

    def _account(self, slots: np.ndarray, lens: np.ndarray, accepted: np.ndarray) -> None:
        self.steps += 1
        self.rows += int(slots.size)
        self.proposed += int(lens.sum())
        self.accepted += int(accepted.sum())
        self.emitted += int(slots.size + accepted.sum())
        # NOTE: tokens after the first rejection were never tested: the geometric model's trials
        self._hits[slots] += accepted
        self._trials[slots] += np.minimum(accepted + 1, lens)

    # ---- bookkeeping -------------------------------------------------------------------------

    def finished(self, req: Any) -> None:
        """A finished sample becomes draft material for later samples of its prompt."""
        self.history.add(tuple(req.prompt_token_ids), np.asarray(req.generated_token_ids, dtype=np.int64))

    def stats(self) -> dict:
        return {
            "spec_steps": self.steps,
            "spec_rows": self.rows,
            "spec_proposed_tokens": self.proposed,
            "spec_accepted_tokens": self.accepted,
            "spec_acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "spec_tokens_per_row": self.emitted / self.rows if self.rows else 0.0,
            "spec_history_prompts": len(self.history),
            **{f"spec_refused_{reason}": count for reason, count in sorted(self.refused.items())},
        }
