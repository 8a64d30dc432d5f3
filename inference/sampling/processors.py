"""vLLM's logit processors as batched tensor ops: one step's sparse indices and dense rows, applied.

`StepProcessors` is what one step needs, built by `ProcessorState.for_rows` (processor_state.py)
from each slot's state; `apply_processors` edits a float32 `[R, V]` copy of the raw logits in
place, in vLLM's order (its result is the same as vLLM v1's sampler up to float rounding):
  1. logit_bias: x[r, t] += bias (sparse);
  2. allowed_token_ids: every other token of the row -inf;
  3. bans: bad words (a sequence's last token when the output ends with the rest of it) and
     min_tokens (EOS and stop ids while fewer tokens are generated): x[r, t] = -inf (sparse);
  4. penalties over dense `[P, V]` rows, with c = the row's output token counts and seen = the
     row's prompt tokens or c > 0: repetition (HF): x / p where x > 0 else x * p, on seen tokens;
     then OpenAI's x -= frequency * c + presence * (c > 0).
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
    """Dense penalty inputs of the `P` penalised rows: `rows [P]` (batch row indices), `counts
    [P, V]` int32 output token counts, `seen [P, V]` bool (prompt or output) or None when no row has a
    repetition penalty; `repetition`, `presence`, `frequency` float32 `[P]`, None when all off."""

    rows: Tensor
    counts: Tensor
    seen: Tensor | None
    repetition: Tensor | None
    presence: Tensor | None
    frequency: Tensor | None


@dataclass(slots=True)
class StepProcessors:
    """One step's processor inputs; every index is a batch row (`[R]` logits row) or a token id.

    `bias_*`: sparse (row, token, value) triples; `allowed_rows [A]` the rows restricted to
    `(allowed_entry_rows, allowed_ids)`; `ban_*`: sparse (row, token) pairs set to -inf;
    `penalties`: the dense part. A None field is a processor no row of the step uses.
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


def apply_processors(x: Tensor, p: StepProcessors) -> Tensor:
    """Apply `p` to the float32 logits `x [R, V]` in place (see the module docstring); returns x."""
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


def _apply_penalties(x: Tensor, pen: Penalties) -> None:
    # NOTE: all rows penalised (the bench's case, and common when a whole batch shares params): edit
    # x itself, no gather / scatter of the rows
    whole = pen.rows.numel() == x.shape[0]
    xp = x if whole else x[pen.rows]
    if pen.repetition is not None:
        r = pen.repetition[:, None]
        scaled = torch.where(xp > 0, xp / r, xp * r)
        kept = torch.where(pen.seen, scaled, xp)
        xp = xp.copy_(kept) if whole else kept
    if pen.frequency is not None:
        xp.sub_(pen.counts * pen.frequency[:, None])
    if pen.presence is not None:
        xp.sub_((pen.counts > 0) * pen.presence[:, None])
    if not whole:
        x[pen.rows] = xp
