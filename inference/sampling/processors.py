"""vLLM's logit processors as batched tensor ops: one step's sparse indices, applied.

`StepProcessors` is what one step needs, built by `ProcessorState.for_rows` (processor_state.py)
from each slot's state; `apply_processors` edits a float32 `[R, V]` copy of the raw logits in
place, in vLLM's order (its result is the same as vLLM v1's sampler up to float rounding):
  0. the grammar's token mask (structured outputs, grammar.py): every token it does not allow -inf;
  1. logit_bias: x[r, t] += bias (sparse);
  2. allowed_token_ids: every other token of the row -inf;
  3. bans: bad words (a sequence's last token when the output ends with the rest of it) and
     min_tokens (EOS and stop ids while fewer tokens are generated): x[r, t] = -inf (sparse);
  4. penalties over the (row, token) pairs the row has seen, c = the token's output count (0 for
     a prompt-only token): repetition (HF): x / p where x > 0 else x * p; then OpenAI's
     x -= frequency * c + presence * (c > 0) (tokens never seen are untouched by both).
A row that uses none of them is never touched, and a step where no row uses any has no
`StepProcessors` at all (the sampler then skips this module).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_NEG_INF = float("-inf")


@dataclass(slots=True)
class Penalties:
    """Sparse penalty inputs: one entry per (row, token) the row has seen (prompt or output; each
    pair once): `rows`, `ids` int64, `counts` float32 (output count, 0 for a prompt-only token) and
    the row's `repetition`, `presence`, `frequency` per entry (float32), None when every row has it off.
    NOTE: a penalty only moves tokens seen before, so this touches those few entries, never whole rows."""

    rows: Tensor
    ids: Tensor
    counts: Tensor
    repetition: Tensor | None
    presence: Tensor | None
    frequency: Tensor | None


@dataclass(slots=True)
class StepProcessors:
    """One step's processor inputs; every index is a batch row (`[R]` logits row) or a token id.

    `bias_*`: sparse (row, token, value) triples; `allowed_rows [A]` the rows restricted to
    `(allowed_entry_rows, allowed_ids)`; `ban_*`: sparse (row, token) pairs set to -inf;
    `penalties`: the seen pairs; `grammar_rows [G]` the rows with a grammar and `grammar_mask
    [G, ceil(V / 32)]` int32 their allowed tokens, bit t % 32 of word t // 32 (llguidance's layout).
    A None field is a processor no row of the step uses.
    """

    bias_rows: Tensor | None = None
    bias_ids: Tensor | None = None
    bias_values: Tensor | None = None
    allowed_rows: Tensor | None = None
    allowed_entry_rows: Tensor | None = None
    allowed_ids: Tensor | None = None
    ban_rows: Tensor | None = None
    ban_ids: Tensor | None = None
    penalties: Penalties | None = None
    grammar_rows: Tensor | None = None
    grammar_mask: Tensor | None = None


def apply_processors(x: Tensor, p: StepProcessors) -> Tensor:
    """Apply `p` to the float32 logits `x [R, V]` in place (see the module docstring); returns x."""
    if p.grammar_rows is not None:
        _apply_grammar(x, p.grammar_rows, p.grammar_mask)
    if p.bias_rows is not None:
        x.index_put_((p.bias_rows, p.bias_ids), p.bias_values, accumulate=True)
    if p.allowed_rows is not None:
        kept = x[p.allowed_entry_rows, p.allowed_ids]
        x[p.allowed_rows] = _NEG_INF
        x[p.allowed_entry_rows, p.allowed_ids] = kept
    if p.ban_rows is not None:
        x[p.ban_rows, p.ban_ids] = _NEG_INF
    if p.penalties is not None:
        _apply_penalties(x, p.penalties)
    return x


# what a mask byte adds to its 8 tokens' logits, for every byte value: 0 where the bit is set, -inf
# where not; one row gather per byte unpacks a bitmask (several times faster than shifting 32 bits)
_BYTE_ADD = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1).bool(), 0.0, _NEG_INF)
_GRAMMAR_CHUNK_BYTES = 2 << 20  # rows of unpacked mask built at once: ~L2-sized, 4x faster than all rows


def _apply_grammar(x: Tensor, rows: Tensor, mask: Tensor) -> None:
    vocab = x.shape[1]
    mask = mask.to(x.device).contiguous()
    table = _BYTE_ADD.to(x.device)
    words = mask.shape[1]
    every_row = rows.numel() == x.shape[0]  # NOTE: rows are sorted and distinct, so every row, in order
    chunk = max(1, _GRAMMAR_CHUNK_BYTES // (words * 32 * 4))
    buf = torch.empty(min(chunk, mask.shape[0]) * words * 32, dtype=x.dtype, device=x.device)
    u8 = mask.view(torch.uint8)  # little-endian words: byte j holds tokens 8j .. 8j + 7
    for start in range(0, mask.shape[0], chunk):
        n = min(chunk, mask.shape[0] - start)
        add = torch.index_select(table, 0, u8[start:start + n].reshape(-1).int(),
                                 out=buf[: n * words * 32].view(-1, 8)).view(n, -1)[:, :vocab]
        if every_row:
            x[start:start + n].add_(add)
        else:
            x.index_add_(0, rows[start:start + n], add)


def _apply_penalties(x: Tensor, pen: Penalties) -> None:
    v = x[pen.rows, pen.ids]
    if pen.repetition is not None:
        v = torch.where(v > 0, v / pen.repetition, v * pen.repetition)
    if pen.frequency is not None:
        v = v - pen.frequency * pen.counts
    if pen.presence is not None:
        v = v - pen.presence * (pen.counts > 0)
    x[pen.rows, pen.ids] = v
