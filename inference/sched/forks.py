"""Forks: the samples 1..n-1 of a group whose prompt was just prefilled join as forks of sample 0,
sharing its full prompt blocks (a mixin of `Scheduler`, over its context and reservations)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(slots=True)
class ForkResult:
    """Samples that sample this step: `slots`, reading logits `rows` (None: rows 0..len-1 in
    order); `kv_copies` are (source, destination) KV blocks to copy for the forks' partial blocks,
    `state_copies` (source, destination) state-pool rows for their recurrent state."""

    slots: np.ndarray
    rows: torch.Tensor | None
    kv_copies: list[tuple[int, int]]
    state_copies: list[tuple[int, int]]


class GroupForks:
    """`Scheduler.fork_groups` (module docstring); the state it writes is the scheduler's."""

    ctx: Any
    _reserved_slots: int

    def fork_groups(self, sample_slots: np.ndarray) -> ForkResult:
        """Samples 1..n-1 of a group whose prompt was just prefilled join as forks of sample 0.

        Full prompt blocks are shared; the partial last one is copied (the caller copies the KV
        of `copies`). A child that cannot get a slot or block now prefills on its own later.
        """
        ctx = self.ctx
        # NOTE: only a leader sampling its first token can have children left to fork
        first = np.flatnonzero(ctx.seq_len[sample_slots] == ctx.prompt_len[sample_slots])
        forked_slots, forked_rows, kv_copies, state_copies = [], [], [], []
        for row in first.tolist():
            slot = int(sample_slots[row])
            req = ctx.requests[slot]
            if not req.fork_children:
                continue
            children, req.fork_children = req.fork_children, []
            self._reserved_slots -= len(children)
            full = int(ctx.prompt_len[slot]) // ctx.block_size
            for child in children:
                child_slot = ctx.fork(slot, child)
                if child_slot is None:  # no block for its partial copy: it prefills on its own
                    self._queue(child, front=True)
                    continue
                child.admitted = True
                child.cached_tokens = req.cached_tokens  # NOTE: its prompt is its leader's, as cached as it was
                self._count_waiting(child.client, -1)
                if ctx.num_blocks[slot] > full:  # the partial last prompt block is copied, not shared
                    kv_copies.append((int(ctx.block_table[slot, full]), int(ctx.block_table[child_slot, full])))
                if ctx.states is not None:
                    state_copies.append((int(ctx.state_slot[slot]), int(ctx.state_slot[child_slot])))
                forked_slots.append(child_slot)
                forked_rows.append(row)
        if not forked_slots:
            return ForkResult(sample_slots, None, kv_copies, state_copies)
        return ForkResult(
            np.concatenate((sample_slots, np.array(forked_slots, dtype=np.int64))),
            torch.cat((torch.arange(sample_slots.size), torch.tensor(forked_rows, dtype=torch.int64))),
            kv_copies,
            state_copies,
        )
