"""What a step's logits become on the requests: sampled tokens, log-probs, streamed token events.

Functions over the context's per-slot arrays, called by the engine core after the forward; the
vectorised path (every slot at once) is the default and per-request Python runs only for the
few rows that asked for extras (top-n log-probs, prompt log-probs, token streaming).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from inference.request import TokenEvent
from inference.sampling.batch import SamplingBatch
from inference.sampling.processors import StepProcessors
from inference.sampling.sampler import compute_prompt_logprobs
from inference.sched.context import DynamicInferenceContext


def sampling_batch(ctx: DynamicInferenceContext, slots: np.ndarray) -> SamplingBatch:
    """The sampler's per-row parameters for `slots`, gathered from the per-slot tensors."""
    index = torch.from_numpy(slots)
    device = ctx.temperature.device
    processors = ctx.processors.for_rows(slots, ctx.tokens, ctx.seq_len, ctx.prompt_len, device=device)
    grammar = ctx.grammars.masks(slots)
    if grammar is not None:
        processors = processors if processors is not None else StepProcessors()
        processors.grammar_rows = torch.from_numpy(grammar[0]).to(device)
        processors.grammar_mask = grammar[1].to(device)
    return SamplingBatch(
        temperature=ctx.temperature[index],
        top_k=ctx.top_k[index],
        top_p=ctx.top_p[index],
        min_p=ctx.min_p[index],
        generators=[ctx.generators[s] for s in slots.tolist()],
        num_top_logprobs=int(ctx.num_top_logprobs[slots].max()),
        logprobs_mode=ctx.processed_logprobs[index],
        processors=processors,
    )


def record_top_logprobs(ctx: DynamicInferenceContext, slots: np.ndarray, out: Any) -> None:
    """Append each row's top-n alternatives to its request (only rows that asked for them)."""
    wanted = ctx.num_top_logprobs[slots]
    for row in np.flatnonzero(wanted).tolist():
        req = ctx.requests[int(slots[row])]
        n = int(wanted[row])
        ids = out.top_token_ids[row, :n].tolist()
        lps = out.top_logprobs[row, :n].tolist()
        if req.top_logprobs is None:
            req.top_logprobs = []
        req.top_logprobs.append(dict(zip(ids, lps)))


def record_prompt_logprobs(ctx: DynamicInferenceContext, batch: Any, logits: torch.Tensor) -> None:
    """Score the prompt tokens of the rows that asked for prompt log-probs this step, by position
    (a recomputed row overwrites its earlier score)."""
    for rows in batch.prompt_rows:
        scores = ctx.requests[rows.slot].prompt_scores
        targets = torch.from_numpy(ctx.tokens[rows.slot, rows.first_token : rows.first_token + rows.count])
        scored = compute_prompt_logprobs(logits[rows.start : rows.start + rows.count],
                                         targets.to(logits.device), scores.top_n)
        scores.write(rows.first_token, scored.logprobs, scored.top_logprobs, scored.top_token_ids, scored.ranks)


def token_events(ctx: DynamicInferenceContext, slots: np.ndarray, tokens: np.ndarray,
                 logprobs: np.ndarray) -> list[TokenEvent]:
    """Events for the just-sampled tokens of streaming slots; call before `update_requests`
    appends them (positions are read here) and releases finished slots."""
    rows = np.flatnonzero(ctx.streams_tokens[slots])
    if rows.size == 0:
        return []
    version = ctx.policy_version
    events = []
    for row in rows.tolist():
        slot = int(slots[row])
        req = ctx.requests[slot]
        index = int(ctx.seq_len[slot] - ctx.prompt_len[slot])
        events.append(TokenEvent(req.request_id, req.sample_index, index, int(tokens[row]),
                                 float(logprobs[row]), version))
    return events


def record_routes(ctx: DynamicInferenceContext, batch: Any, routes: np.ndarray) -> None:
    """Keep the experts each computed token went to (`routes [tokens, moe_layers, k]`, the step's
    token order) for the requests that asked, by token position (a recomputed position overwrites)."""
    rows = np.flatnonzero(ctx.returns_routes[batch.token_slots])
    if rows.size == 0:
        return
    slots, positions = batch.token_slots[rows], batch.token_positions[rows]
    for slot in np.unique(slots).tolist():
        req = ctx.requests[slot]
        if req.routed_experts is None:
            req.routed_experts = np.zeros((req.max_total_tokens, *routes.shape[1:]), dtype=np.int16)
        mine = slots == slot
        req.routed_experts[positions[mine]] = routes[rows[mine]]
