"""Turns a `StepPlan` into the model's flat-batch inputs with a handful of vectorised gathers.

Rows of the flat batch: request `b` (slot `slots[b]`) owns `query_lens[b]` consecutive rows,
positions `kv_len .. kv_len + q - 1`. The logits the model returns are, in order: one row per
request that samples this step (its chunk reaches the end of its known tokens), then the rows
whose prompt log-probs were asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from inference.attention.metadata import AttentionMetadata
from inference.sched.context import DynamicInferenceContext
from inference.sched.scheduler import StepPlan


@dataclass(slots=True)
class PromptLogprobRows:
    """Logits rows `[start, start + count)` score prompt tokens `first_token .. first_token + count - 1`."""

    slot: int
    start: int
    count: int
    first_token: int


@dataclass(slots=True)
class StepBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_slots: np.ndarray  # slots that sample a token, in logits-row order
    prompt_rows: list[PromptLogprobRows]
    prompt_tokens: int  # prompt tokens whose K/V this step computes


def build_step_batch(ctx: DynamicInferenceContext, plan: StepPlan, device: torch.device) -> StepBatch:
    slots, q = plan.slots, plan.query_lens
    bs = ctx.block_size
    kv0 = ctx.kv_len[slots]
    kv1 = kv0 + q
    ends = np.cumsum(q)
    starts = ends - q
    num_tokens = int(ends[-1])
    if plan.num_decode == slots.size:  # decode-only step: one row per request
        token_slots, positions = slots, kv0
    else:
        token_slots = np.repeat(slots, q)
        positions = np.arange(num_tokens) - np.repeat(starts - kv0, q)
    input_ids = ctx.tokens[token_slots, positions]
    slot_mapping = ctx.block_table[token_slots, positions // bs].astype(np.int64) * bs + positions % bs
    width = int(-(-kv1.max() // bs))
    block_tables = ctx.block_table[slots, :width]

    samples = kv1 == ctx.seq_len[slots]
    sample_slots = slots[samples]
    rows = [ends[samples] - 1]
    prompt_rows: list[PromptLogprobRows] = []
    prompt_len = ctx.prompt_len[slots]
    wants = ctx.wants_prompt_logprobs[slots] & (kv0 < prompt_len - 1)
    next_row = int(samples.sum())
    for b in np.flatnonzero(wants).tolist():
        # row at position p scores token p + 1; only prompt tokens are scored here
        first, last = int(kv0[b]), min(int(kv1[b]), int(prompt_len[b]) - 1)
        if last > first:
            rows.append(np.arange(starts[b], starts[b] + last - first))
            prompt_rows.append(PromptLogprobRows(int(slots[b]), next_row, last - first, first + 1))
            next_row += last - first
    logits_indices = np.concatenate(rows) if len(rows) > 1 else rows[0]
    prompt_tokens = int(np.clip(np.minimum(kv1, prompt_len) - kv0, 0, None).sum())

    def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    meta = AttentionMetadata(
        query_start_loc=t(np.concatenate(([0], ends)), torch.int32),
        seq_lens=t(kv1, torch.int32),
        block_tables=t(block_tables, torch.int32),
        slot_mapping=t(slot_mapping, torch.int64),
        max_query_len=int(q.max()),
        max_seq_len=int(kv1.max()),
    )
    return StepBatch(
        input_ids=t(input_ids, torch.int64),
        positions=t(positions, torch.int64),
        meta=meta,
        logits_indices=t(logits_indices, torch.int64),
        sample_slots=sample_slots,
        prompt_rows=prompt_rows,
        prompt_tokens=prompt_tokens,
    )
