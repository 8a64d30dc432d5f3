"""A speculative decode step: propose tokens per request, verify them all in one forward.

Taken only for a decode-only step of at most `SpeculativeConfig.max_rows` requests (the tail of a
batch, where a step is mostly fixed cost) whose proposals pay by the step cost model (class
docstring); a larger batch, or one where nothing pays, decodes as usual. For each request the step
feeds its last token plus `d` proposed tokens (their K/V written into its blocks), samples the
target at all `d + 1` positions and keeps the leading samples that confirm the proposals, plus the
one sample after them (see speculation/verify.py).

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

import time
from collections import Counter
from typing import Any

import numpy as np
import torch

from inference.config import SpeculativeConfig
from inference.core import outputs as out_ops
from inference.sampling.sampler import SamplerOutput
from inference.sched.block_registration import register_full_blocks
from inference.sched.scheduler import StepPlan
from inference.speculation.costs import StepCosts
from inference.speculation.history import PromptHistory
from inference.speculation.proposer import build_corpus, propose
from inference.speculation.verify import accepted_counts, cut_at_stops

# A request's calibration: its proposals' estimated chances are scaled by (tokens kept + w) /
# (tokens the estimates expected + w), the evidence fading by EVIDENCE_DECAY per step it decodes,
# so a request whose corpus matches keep failing (high-entropy text that happens to match)
# proposes less, and tries again once its failures are old.
CALIBRATION_WEIGHT, EVIDENCE_DECAY = 2.0, 0.9


class SpeculativeSteps:
    """Proposals and verify steps of one `EngineCore` (see module docstring). `core` is not
    imported here: the core imports this module.

    Which proposals a step verifies: each proposed token carries its estimated chance of being
    kept (speculation/proposer.py, times the request's calibration); the step verifies the best
    ones, as many as maximise tokens per second under the measured cost of a step by its token
    count (speculation/costs.py). So a request whose draft is likely proposes far, a doubtful one
    little, and a step where no proposal pays decodes plainly.

    Invariant: per slot, `owner` is the request id the calibration belongs to; a slot taken by
    another request starts afresh.
    """

    def __init__(self, core: Any, config: SpeculativeConfig) -> None:
        self.core = core
        self.config = config
        self.history = PromptHistory(config.history_samples, config.history_prompts)
        self.costs = StepCosts(min(core.config.max_batch_tokens, config.max_step_tokens),
                               measured=config.cost_model == "measured")
        n = core.config.max_requests
        self._owner = np.full(n, -1, dtype=np.int64)
        self._kept = np.zeros(n, dtype=np.float64)  # proposed tokens kept (fading evidence)
        self._expected = np.zeros(n, dtype=np.float64)  # what their estimated chances expected
        self._refused = np.zeros(n, dtype=bool)
        self._prompt_key: list[tuple[int, ...] | None] = [None] * n
        self._chances: list[np.ndarray] = []  # the verified proposals' chances before calibration, this step
        self.steps = self.rows = self.proposed = self.accepted = self.emitted = 0
        self.expected = 0.0
        self.refused: Counter[str] = Counter()

    # ---- the step ----------------------------------------------------------------------------

    def step(self, plan: StepPlan) -> None:
        """Run `plan`: as a verify step if it is a small decode-only step with proposals that pay,
        else as usual. A decode-only step's wall time is recorded by its token count."""
        core = self.core
        decode_only = plan.num_decode == plan.slots.size
        start = time.perf_counter()
        drafts = None
        if decode_only and plan.slots.size <= self.config.max_rows and not self._forks_pending(plan.slots):
            drafts = self._propose(plan.slots)
        if drafts is None:
            core.run_plan(plan, core.runner.prepare(core.context, plan))
            tokens = int(plan.slots.size)
        else:
            self._verify(plan, drafts)
            tokens = int(plan.slots.size + sum(d.size for d in drafts))
        if decode_only:
            self.costs.record(tokens, time.perf_counter() - start)

    def _forks_pending(self, slots: np.ndarray) -> bool:
        """Whether a group leader samples its first token this step: its samples fork from it in
        the plain step (`Scheduler.fork_groups`), never in a verify one. NOTE: a prompt whose last
        chunk is one token (chunk boundaries, a cached prefix) decodes it, so this does happen."""
        ctx = self.core.context
        first = slots[ctx.seq_len[slots] == ctx.prompt_len[slots]]
        return any(ctx.requests[slot].fork_children for slot in first.tolist())

    def _propose(self, slots: np.ndarray) -> list[np.ndarray] | None:
        """Each slot's proposed tokens to verify, their blocks taken; None when none pays."""
        ctx, cfg = self.core.context, self.config
        groups: dict[int, list[int]] = {}
        for slot in slots.tolist():
            groups.setdefault(ctx.requests[slot].group_id, []).append(slot)
        self._kept[slots] *= EVIDENCE_DECAY
        self._expected[slots] *= EVIDENCE_DECAY
        calibration = (self._kept[slots] + CALIBRATION_WEIGHT) / (self._expected[slots] + CALIBRATION_WEIGHT)
        empty, none = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
        drafts, raw = [], []  # raw: the proposer's chances (the calibration compares with them)
        for slot in slots.tolist():
            room = min(cfg.num_tokens, int(ctx.max_len[slot] - ctx.seq_len[slot]) - 1)
            if room < 1 or not self._may_propose(slot):
                drafts.append(empty)
                raw.append(none)
                continue
            seq = ctx.tokens[slot, : int(ctx.seq_len[slot])]
            siblings = [ctx.tokens[s, ctx.prompt_len[s] : ctx.seq_len[s]] for s in groups[ctx.requests[slot].group_id]
                        if s != slot]
            corpus = build_corpus(self.history.of(self._prompt_key[slot]) + siblings + [seq])
            draft, chance = propose(seq[-cfg.max_match :], corpus, room, cfg.min_match, cfg.max_match,
                                    cfg.min_acceptance)
            drafts.append(draft)
            raw.append(chance)
        counts = self._choose(slots.size, [np.minimum(c * f, 1.0) for c, f in zip(raw, calibration.tolist())])
        if not counts.any():
            return None
        watermark = self.core.scheduler.watermark_blocks
        self._chances = []
        for b, slot in enumerate(slots.tolist()):
            draft = drafts[b][: counts[b]]
            kv_end = int(ctx.kv_len[slot]) + 1 + draft.size
            if draft.size and (ctx.allocator.available - ctx.blocks_needed(slot, kv_end) < watermark
                               or not ctx.grow(slot, kv_end)):
                draft = empty
            if draft.size:
                seq_len = int(ctx.seq_len[slot])
                ctx.tokens[slot, seq_len : seq_len + draft.size] = draft  # NOTE: past seq_len: scratch until kept
            drafts[b] = draft
            self._chances.append(raw[b][: draft.size])
        return drafts if any(d.size for d in drafts) else None

    def _choose(self, rows: int, chances: list[np.ndarray]) -> np.ndarray:
        """Per row, how many of its proposals to verify: the step's best ones by chance, as many as
        `StepCosts.best_extra` says pay. A row's chances fall along its draft, so each row's chosen
        proposals are a prefix of its draft."""
        flat = np.concatenate(chances)
        if flat.size == 0:
            return np.zeros(rows, dtype=np.int64)
        row = np.repeat(np.arange(rows), [c.size for c in chances])
        depth = np.concatenate([np.arange(c.size) for c in chances])
        order = np.lexsort((depth, -flat))
        k = self.costs.best_extra(rows, flat[order])
        return np.bincount(row[order[:k]], minlength=rows)

    def _may_propose(self, slot: int) -> bool:
        """Whether the slot's request may speculate at all (counts a refusal once per admission)."""
        ctx = self.core.context
        req = ctx.requests[slot]
        if self._owner[slot] != req.request_id:
            self._owner[slot] = req.request_id
            self._kept[slot] = self._expected[slot] = 0.0
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
        is_stop = ctx.finishes(row_slots, sampled)
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
        expected = np.array([c.sum() for c in self._chances], dtype=np.float64)
        self.expected += float(expected.sum())
        self._kept[slots] += accepted
        self._expected[slots] += expected

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
            "spec_expected_tokens": self.expected,
            "spec_history_prompts": len(self.history),
            **{f"spec_refused_{reason}": count for reason, count in sorted(self.refused.items())},
        }
