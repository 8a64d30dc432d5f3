"""A step's model inputs, written into persistent buffers with a handful of vectorised gathers.

Rows of the flat batch: request `b` (slot `slots[b]`) owns `query_lens[b]` consecutive rows,
positions `kv_len .. kv_len + q - 1`. The logits the model returns are, in order: one row per
request that samples this step (its chunk reaches the end of its known tokens; a speculative
verify step is made of one-token requests, one per position verified, each sampled), then the rows
whose prompt log-probs were asked for, then (with padding) one row per padding token.

Every field lives at a fixed offset of one byte buffer sized at start (`InputBuffers`): the
host fills it through numpy views and one host-to-device copy of its used prefix moves it all
(on CPU the host buffer *is* the device buffer: no copy). So the tensors handed to the model
keep their `data_ptr` from step to step, which CUDA graphs need.

Padded (`padded` tokens, the step's bucket, see `buckets.py`), the real tokens are followed by
one-token requests that write their K/V into a scratch block and their state into a scratch state
row, so the model sees only a few distinct batch shapes. A *dummy* step (`fill_dummy_inputs`) is
made of such requests only: what an expert-parallel rank without requests runs while its peers
work. It holds no KV block and touches no request, so the prefix cache is left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from inference.attention.metadata import AttentionMetadata
from inference.models.protocol import VerifyRows
from inference.runner.buckets import pick_bucket
from inference.sched.context import DynamicInferenceContext
from inference.sched.scheduler import StepPlan

MAX_CACHED_SHAPES = 256  # step shapes whose tensor views InputBuffers keeps

__all__ = ["InputBuffers", "PromptLogprobRows", "StepInputs", "fill_dummy_inputs", "fill_inputs", "pick_bucket"]


@dataclass(slots=True)
class PromptLogprobRows:
    """Logits rows `[start, start + count)` score prompt tokens `first_token .. first_token + count - 1`."""

    slot: int
    start: int
    count: int
    first_token: int


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs (views of the persistent buffers) and how to read its logits."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    state_slots: Optional[torch.Tensor]  # [B] state-pool row of each request (stateful models)
    state_fresh: Optional[torch.Tensor]  # [B] bool: the request starts from a zero state
    sample_slots: np.ndarray  # slots that sample a token, in logits-row order
    prompt_rows: list[PromptLogprobRows]
    prompt_tokens: int  # prompt tokens whose K/V this step computes
    num_tokens: int  # real tokens (padding excluded)
    num_padding: int  # padding tokens (= padding requests) after the real ones
    num_decode: int = 0  # the first requests that decode one token (the plan's decodes)
    token_slots: Optional[np.ndarray] = None  # the slot of each real token (recording routes)
    token_positions: Optional[np.ndarray] = None  # its position in its request
    record_routes: bool = False  # an MoE model records each token's experts (a request asked)
    # LoRA: the resident adapter id of every row, padding included (-1: the base model), and the
    # rows whose logits are taken (host copies); None when no request of the step has an adapter
    lora_ids: Optional[np.ndarray] = None
    logits_rows: Optional[np.ndarray] = None
    # a verify step of a stateful model: its requests' rows (the state batch is one per request)
    verify: Optional[VerifyRows] = None

    @property
    def padded_tokens(self) -> int:
        return self.num_tokens + self.num_padding


class InputBuffers:
    """Fixed-offset regions of one byte buffer (see module docstring); the block tables come last
    so that a step copies only the prefix it used."""

    _INT64 = ("input_ids", "positions", "slot_mapping", "logits_indices", "state_slots")
    _INT32 = ("query_start_loc", "seq_lens")

    def __init__(self, max_tokens: int, max_blocks_per_request: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.width = max_blocks_per_request
        self.device = torch.device(device)
        layout: dict[str, tuple[int, int, np.dtype]] = {}  # name -> (byte offset, count, dtype)
        offset = 0
        for name in self._INT64:
            layout[name] = (offset, max_tokens, np.dtype(np.int64))
            offset += 8 * max_tokens
        for name, count in (("query_start_loc", max_tokens + 1), ("seq_lens", max_tokens)):
            layout[name] = (offset, count, np.dtype(np.int32))
            offset += 4 * count
        layout["state_fresh"] = (offset, max_tokens, np.dtype(np.bool_))
        offset = -(-(offset + max_tokens) // 8) * 8
        layout["block_tables"] = (offset, max_tokens * max_blocks_per_request, np.dtype(np.int32))
        self.nbytes = offset + 4 * max_tokens * max_blocks_per_request
        self._layout = layout
        on_cpu = self.device.type == "cpu"
        self.host = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=not on_cpu and torch.cuda.is_available())
        self.dev = self.host if on_cpu else torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        raw = self.host.numpy()
        self.np = {name: raw[o:o + n * d.itemsize].view(d) for name, (o, n, d) in layout.items()}
        torch_dtype = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                       np.dtype(np.bool_): torch.bool}
        self.t = {name: self.dev[o:o + n * d.itemsize].view(torch_dtype[d]) for name, (o, n, d) in layout.items()}
        self.t_host = {name: self.host[o:o + n * d.itemsize].view(torch_dtype[d])
                       for name, (o, n, d) in layout.items()}
        self.arange = np.arange(max_tokens + 1, dtype=np.int64)  # NOTE: a decode step's query starts and rows
        self._views: dict[tuple[int, int, int, int], tuple[torch.Tensor, ...]] = {}

    def views(self, padded: int, total_reqs: int, width: int, num_rows: int) -> tuple[torch.Tensor, ...]:
        """The step's tensors over the buffers (input ids, positions, query starts, seq lens, block
        tables, slot mapping, logits rows; then host query starts and seq lens), made once per
        shape: a run at a steady batch asks for the same few shapes every step."""
        shape = (padded, total_reqs, width, num_rows)
        found = self._views.get(shape)
        if found is None:
            if len(self._views) >= MAX_CACHED_SHAPES:
                self._views.clear()
            t, th = self.t, self.t_host
            found = self._views[shape] = (
                t["input_ids"][:padded], t["positions"][:padded], t["query_start_loc"][: total_reqs + 1],
                t["seq_lens"][:total_reqs], t["block_tables"][: total_reqs * width].view(total_reqs, width),
                t["slot_mapping"][:padded], t["logits_indices"][:num_rows],
                th["query_start_loc"][: total_reqs + 1], th["seq_lens"][:total_reqs])
        return found

    def upload(self, table_entries: int) -> None:
        """One host-to-device copy of everything this step wrote (a no-op on CPU)."""
        if self.dev is self.host:
            return
        end = self._layout["block_tables"][0] + 4 * table_entries
        self.dev[:end].copy_(self.host[:end], non_blocking=True)


def fill_inputs(buf: InputBuffers, ctx: DynamicInferenceContext, plan: StepPlan, *,
                padded: Optional[int] = None, scratch_block: Optional[int] = None,
                scratch_state: Optional[int] = None) -> StepInputs:
    """Write the step of `plan` into `buf` and return views of it; with `padded` (and a scratch
    block to pad into), padded to that many tokens."""
    slots, q = plan.slots, plan.query_lens
    request_slots, request_lens = slots, q
    bs = ctx.block_size
    kv0 = ctx.kv_len[slots]
    if plan.verify:
        # NOTE: each verified token attends as a decode of its own (one query row over its request's
        # blocks, up to its own position), so its logits are the ones a decode step computes
        offsets = np.arange(int(q.sum())) - np.repeat(np.cumsum(q) - q, q)
        slots, kv0, q = np.repeat(slots, q), np.repeat(kv0, q) + offsets, np.ones(int(q.sum()), dtype=np.int64)
    kv1 = kv0 + q
    num_reqs = slots.size
    # NOTE: decodes only (no verify): one row each, every one samples, none scores its prompt
    decodes = plan.num_decode == num_reqs and not plan.verify
    ends = buf.arange[1 : num_reqs + 1] if decodes else np.cumsum(q)
    starts = ends - 1 if decodes else ends - q
    num_tokens = int(ends[-1])
    padded = num_tokens if padded is None or scratch_block is None else padded
    if padded < num_tokens:
        raise ValueError(f"fill_inputs: {num_tokens} tokens do not fit a bucket of {padded}")
    pad = padded - num_tokens
    total_reqs = num_reqs + pad
    if plan.num_decode == num_reqs or plan.verify:  # decode-only step: one row per request
        token_slots, positions = slots, kv0
    else:
        token_slots = np.repeat(slots, q)
        positions = np.arange(num_tokens) - np.repeat(starts - kv0, q)
    n = buf.np
    n["input_ids"][:num_tokens] = ctx.tokens[token_slots, positions]
    n["positions"][:num_tokens] = positions
    n["slot_mapping"][:num_tokens] = ctx.block_table[token_slots, positions // bs] * bs + positions % bs
    max_seq_len = int(kv1.max())
    width = -(-max_seq_len // bs)
    tables = n["block_tables"][: total_reqs * width].reshape(total_reqs, width)
    tables[:num_reqs] = ctx.block_table[slots, :width]
    qsl, seq_lens = n["query_start_loc"], n["seq_lens"]
    qsl[0] = 0
    qsl[1 : num_reqs + 1] = ends
    seq_lens[:num_reqs] = kv1
    if pad:  # one-token requests at position 0 of the scratch block
        n["input_ids"][num_tokens:padded] = 0
        n["positions"][num_tokens:padded] = 0
        n["slot_mapping"][num_tokens:padded] = scratch_block * bs
        tables[num_reqs:] = scratch_block
        qsl[num_reqs + 1 : total_reqs + 1] = num_tokens + np.arange(1, pad + 1)
        seq_lens[num_reqs:total_reqs] = 1

    prompt_rows: list[PromptLogprobRows] = []
    prompt_len = ctx.prompt_len[slots]
    if decodes:  # NOTE: a decode's token is at most its prompt's last (run as a decode after a cache hit)
        sample_slots, rows, next_row = slots, [buf.arange[:num_tokens]], num_tokens
        prompt_tokens = int(np.count_nonzero(kv0 < prompt_len))
    elif plan.verify:  # NOTE: a speculative step samples at every position of its requests
        sample_slots, rows, next_row = slots, [np.arange(num_tokens)], num_tokens
    else:
        samples = kv1 == ctx.seq_len[slots]
        sample_slots, rows, next_row = slots[samples], [ends[samples] - 1], int(samples.sum())
    wants = np.empty(0, dtype=np.int64) if decodes else \
        np.flatnonzero(ctx.wants_prompt_logprobs[slots] & (kv0 < prompt_len - 1))
    for b in wants.tolist():
        # row at position p scores token p + 1; only prompt tokens are scored here
        first, last = int(kv0[b]), min(int(kv1[b]), int(prompt_len[b]) - 1)
        if last > first:
            rows.append(np.arange(starts[b], starts[b] + last - first))
            prompt_rows.append(PromptLogprobRows(int(slots[b]), next_row, last - first, first + 1))
            next_row += last - first
    if pad:
        rows.append(np.arange(num_tokens, padded))
    num_rows = sum(r.size for r in rows)
    if len(rows) == 1:
        n["logits_indices"][:num_rows] = rows[0]
    else:
        np.concatenate(rows, out=n["logits_indices"][:num_rows])
    if not decodes:
        prompt_tokens = int(np.maximum(np.minimum(kv1, prompt_len) - kv0, 0).sum())

    state_slots = state_fresh = verify = None
    if ctx.states is not None and plan.verify:
        # NOTE: a recurrent layer runs each request's verify rows in order from its one state row
        b = request_slots.size
        n["state_slots"][:b] = ctx.state_slot[request_slots]
        n["state_fresh"][:b] = False  # NOTE: a verify step is made of decodes: each follows its prefill
        state_slots, state_fresh = buf.t["state_slots"][:b], buf.t["state_fresh"][:b]
        verify = VerifyRows(request_lens.tolist())
    elif ctx.states is not None:
        n["state_slots"][:num_reqs] = ctx.state_slot[slots]
        n["state_fresh"][:num_reqs] = kv0 == 0
        if pad:
            n["state_slots"][num_reqs:total_reqs] = scratch_state
            n["state_fresh"][num_reqs:total_reqs] = True
        state_slots, state_fresh = buf.t["state_slots"][:total_reqs], buf.t["state_fresh"][:total_reqs]

    lora_ids = None
    req_loras = ctx.lora_id[slots]
    if req_loras.max() >= 0:  # NOTE: one reduction over the batch's requests; nothing more without adapters
        lora_ids = np.full(padded, -1, dtype=np.int64)
        lora_ids[:num_tokens] = req_loras if plan.num_decode == num_reqs else np.repeat(req_loras, q)

    buf.upload(total_reqs * width)
    input_ids, positions_t, qsl_t, seq_lens_t, tables_t, slot_mapping, logits_indices, qsl_cpu, seq_lens_cpu = \
        buf.views(padded, total_reqs, width, num_rows)
    meta = AttentionMetadata(
        query_start_loc=qsl_t,
        seq_lens=seq_lens_t,
        block_tables=tables_t,
        slot_mapping=slot_mapping,
        max_query_len=1 if decodes else int(q.max()),
        max_seq_len=max_seq_len,
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
    )
    return StepInputs(
        input_ids=input_ids,
        positions=positions_t,
        meta=meta,
        logits_indices=logits_indices,
        state_slots=state_slots,
        state_fresh=state_fresh,
        sample_slots=sample_slots,
        prompt_rows=prompt_rows,
        prompt_tokens=prompt_tokens,
        num_tokens=num_tokens,
        num_padding=pad,
        num_decode=plan.num_decode,
        token_slots=token_slots,
        token_positions=positions,
        record_routes=bool(ctx.returns_routes[slots].any()),
        lora_ids=lora_ids,
        logits_rows=None if lora_ids is None else n["logits_indices"][:num_rows].copy(),
        verify=verify,
    )


def fill_dummy_inputs(buf: InputBuffers, num_tokens: int, block_size: int, scratch_block: int, *,
                      scratch_state: Optional[int] = None) -> StepInputs:
    """A step of `num_tokens` one-token requests at position 0 of the scratch block (and scratch
    state row): the shape of a real step, without a request or a KV block; no logits are computed."""
    n, t, th = buf.np, buf.t, buf.t_host
    n["input_ids"][:num_tokens] = 0
    n["positions"][:num_tokens] = 0
    n["slot_mapping"][:num_tokens] = scratch_block * block_size
    n["query_start_loc"][: num_tokens + 1] = np.arange(num_tokens + 1)
    n["seq_lens"][:num_tokens] = 1
    n["block_tables"][:num_tokens] = scratch_block  # one column: [num_tokens, 1]
    state_slots = state_fresh = None
    if scratch_state is not None:
        n["state_slots"][:num_tokens] = scratch_state
        n["state_fresh"][:num_tokens] = True
        state_slots, state_fresh = t["state_slots"][:num_tokens], t["state_fresh"][:num_tokens]
    buf.upload(num_tokens)
    meta = AttentionMetadata(
        query_start_loc=t["query_start_loc"][: num_tokens + 1],
        seq_lens=t["seq_lens"][:num_tokens],
        block_tables=t["block_tables"][:num_tokens].view(num_tokens, 1),
        slot_mapping=t["slot_mapping"][:num_tokens],
        max_query_len=1,
        max_seq_len=1,
        query_start_loc_cpu=th["query_start_loc"][: num_tokens + 1],
        seq_lens_cpu=th["seq_lens"][:num_tokens],
    )
    return StepInputs(
        input_ids=t["input_ids"][:num_tokens],
        positions=t["positions"][:num_tokens],
        meta=meta,
        logits_indices=t["logits_indices"][:0],
        state_slots=state_slots,
        state_fresh=state_fresh,
        sample_slots=np.empty(0, dtype=np.int64),
        prompt_rows=[],
        prompt_tokens=0,
        num_tokens=0,
        num_padding=num_tokens,
    )
