"""Each slot's logit-processor state, kept incrementally, and the step inputs built from it.

The context is the one writer: `bind` when a request takes a slot (its prompt and the output it
already has, after a preemption), `append` with each step's sampled tokens, `release` when it
leaves. Penalised slots hold a row of a dense pool: output token counts `[V]` int32 (+1 per
sampled token, never recounted) and the prompt's token set `[V]` bool (repetition only). The
other processors are small per-slot index arrays; `for_rows` concatenates those of the step's
rows into sparse index tensors (one Python item per row that uses a processor, none for the rest)
and matches bad words against the output tails with one vectorised gather.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from inference.sampling.params import SamplingParams
from inference.sampling.processors import Penalties, StepProcessors

_NO_ROW = -1


class ProcessorState:
    """Per-slot processor state for `slots` slots over a `vocab_size` vocabulary.

    Invariants: `uses[s]` iff slot s is bound to a request with `uses_processors`; a slot with
    penalties owns pool row `pen_row[s]` (no other slot does), whose counts are the output tokens
    appended since `bind` plus those it was bound with; free pool rows are in `_free_rows`.
    """

    __slots__ = ("vocab_size", "eos_token_ids", "device", "uses", "bias", "allowed", "bad_single", "bad_multi",
                 "min_tokens", "min_stops", "pen_row", "repetition", "presence", "frequency", "counts", "seen",
                 "_free_rows")

    def __init__(self, slots: int, vocab_size: int, eos_token_ids=(), device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = np.asarray(sorted(eos_token_ids), dtype=np.int64)
        self.device = torch.device(device)
        self.uses = np.zeros(slots, dtype=bool)
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * slots
        self.allowed: list[np.ndarray | None] = [None] * slots
        self.bad_single: list[np.ndarray | None] = [None] * slots  # always banned (1-token bad words)
        self.bad_multi: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * slots  # prefix, len, last
        self.min_tokens = np.zeros(slots, dtype=np.int64)
        self.min_stops: list[np.ndarray | None] = [None] * slots  # banned while under min_tokens
        self.pen_row = np.full(slots, _NO_ROW, dtype=np.int64)
        self.repetition = np.ones(slots, dtype=np.float32)
        self.presence = np.zeros(slots, dtype=np.float32)
        self.frequency = np.zeros(slots, dtype=np.float32)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)  # prompt tokens
        self._free_rows: list[int] = []

    # ---- the writer's calls ------------------------------------------------------------------

    def bind(self, slot: int, p: SamplingParams, prompt: np.ndarray, output: np.ndarray) -> None:
        """Slot `slot` now serves a request with params `p`, prompt and output token ids so far."""
        self.release(slot)
        if not p.uses_processors:
            return
        self.uses[slot] = True
        if p.logit_bias:
            self.bias[slot] = (np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias)),
                               np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias)))
        if p.allowed_token_ids is not None:
            self.allowed[slot] = np.unique(np.asarray(p.allowed_token_ids, dtype=np.int64))
        if p.bad_words_token_ids:
            single = [w[0] for w in p.bad_words_token_ids if len(w) == 1]
            multi = [w for w in p.bad_words_token_ids if len(w) > 1]
            self.bad_single[slot] = np.asarray(single, dtype=np.int64) if single else None
            if multi:
                width = max(len(w) for w in multi) - 1
                prefix = np.full((len(multi), width), -1, dtype=np.int64)
                for i, w in enumerate(multi):
                    prefix[i, : len(w) - 1] = w[:-1]
                self.bad_multi[slot] = (prefix, np.array([len(w) - 1 for w in multi], dtype=np.int64),
                                        np.array([w[-1] for w in multi], dtype=np.int64))
        if p.min_tokens > 0:
            # NOTE: as vLLM: EOS counts as a stop (so is banned) unless the request ignores it
            stops = p.stop_token_ids if p.ignore_eos else [*p.stop_token_ids, *self.eos_token_ids.tolist()]
            if stops:
                self.min_tokens[slot] = p.min_tokens
                self.min_stops[slot] = np.unique(np.asarray(stops, dtype=np.int64))
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            row = self._take_row()
            self.pen_row[slot] = row
            self.repetition[slot] = p.repetition_penalty
            self.presence[slot] = p.presence_penalty
            self.frequency[slot] = p.frequency_penalty
            if output.size:
                self.counts[row] = torch.bincount(torch.from_numpy(output), minlength=self.vocab_size).to(
                    device=self.device, dtype=torch.int32)
            if p.repetition_penalty != 1.0:
                self.seen[row, torch.from_numpy(np.asarray(prompt, dtype=np.int64)).to(self.device)] = True

    def append(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Each of `slots` sampled the matching token of `tokens` (one step's, slots distinct)."""
        rows = self.pen_row[slots]
        mine = rows != _NO_ROW
        if mine.any():
            r = torch.from_numpy(rows[mine]).to(self.device)
            t = torch.from_numpy(np.asarray(tokens, dtype=np.int64)[mine]).to(self.device)
            self.counts[r, t] += 1

    def release(self, slot: int) -> None:
        """Forget `slot`'s state (its request left the slot)."""
        if not self.uses[slot]:
            return
        self.uses[slot] = False
        self.bias[slot] = self.allowed[slot] = self.bad_single[slot] = self.bad_multi[slot] = None
        self.min_tokens[slot] = 0
        self.min_stops[slot] = None
        row = int(self.pen_row[slot])
        if row != _NO_ROW:
            self.counts[row] = 0
            self.seen[row] = False
            self._free_rows.append(row)
            self.pen_row[slot] = _NO_ROW
            self.repetition[slot], self.presence[slot], self.frequency[slot] = 1.0, 0.0, 0.0

    def reset(self) -> None:
        for slot in np.flatnonzero(self.uses).tolist():
            self.release(slot)

    def _take_row(self) -> int:
        if not self._free_rows:  # grow the pool by doubling; rows are only ever zeroed on release
            old = self.counts.shape[0]
            new = max(4, 2 * old)
            self.counts = torch.cat((self.counts, self.counts.new_zeros(new - old, self.vocab_size)))
            self.seen = torch.cat((self.seen, self.seen.new_zeros(new - old, self.vocab_size)))
            self._free_rows.extend(range(new - 1, old - 1, -1))
        return self._free_rows.pop()

    # ---- one step's inputs -------------------------------------------------------------------

    def for_rows(self, slots: np.ndarray, tokens: np.ndarray, seq_len: np.ndarray, prompt_len: np.ndarray,
                 device: torch.device | str | None = None) -> StepProcessors | None:
        """The processor inputs of a step sampling `slots` (row i = slot slots[i]); None when no row
        uses a processor. `tokens [slots, length]`, `seq_len`, `prompt_len`: the context's arrays."""
        use = self.uses[slots]
        if not use.any():
            return None
        dev = self.device if device is None else torch.device(device)
        rows = np.flatnonzero(use)
        out = StepProcessors()
        bias = [(r, self.bias[s]) for r, s in zip(rows.tolist(), slots[rows].tolist()) if self.bias[s] is not None]
        if bias:
            out.bias_rows = _tensor(np.concatenate([np.full(b[0].size, r) for r, b in bias]), dev)
            out.bias_ids = _tensor(np.concatenate([b[0] for _, b in bias]), dev)
            out.bias_values = torch.from_numpy(np.concatenate([b[1] for _, b in bias])).to(dev)
        allowed = [(r, self.allowed[s]) for r, s in zip(rows.tolist(), slots[rows].tolist())
                   if self.allowed[s] is not None]
        if allowed:
            out.allowed_rows = _tensor(np.array([r for r, _ in allowed]), dev)
            out.allowed_entry_rows = _tensor(np.concatenate([np.full(a.size, r) for r, a in allowed]), dev)
            out.allowed_ids = _tensor(np.concatenate([a for _, a in allowed]), dev)
        ban_rows, ban_ids = self._bans(rows, slots, tokens, seq_len, prompt_len)
        if ban_rows is not None:
            out.ban_rows, out.ban_ids = _tensor(ban_rows, dev), _tensor(ban_ids, dev)
        pen = rows[self.pen_row[slots[rows]] != _NO_ROW]
        if pen.size:
            out.penalties = self._penalties(pen, slots[pen], dev)
        return out

    def _bans(self, rows: np.ndarray, slots: np.ndarray, tokens: np.ndarray, seq_len: np.ndarray,
              prompt_len: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        parts_r, parts_t = [], []
        out_len = seq_len - prompt_len  # per slot, tokens generated so far
        for r, s in zip(rows.tolist(), slots[rows].tolist()):
            single = self.bad_single[s]
            if single is not None:
                parts_r.append(np.full(single.size, r))
                parts_t.append(single)
            if self.min_stops[s] is not None and out_len[s] < self.min_tokens[s]:
                parts_r.append(np.full(self.min_stops[s].size, r))
                parts_t.append(self.min_stops[s])
        multi = [(r, s, self.bad_multi[s]) for r, s in zip(rows.tolist(), slots[rows].tolist())
                 if self.bad_multi[s] is not None]
        if multi:
            width = max(m[0].shape[1] for _, _, m in multi)
            prefix = np.concatenate([np.pad(m[0], ((0, 0), (0, width - m[0].shape[1])), constant_values=-1)
                                     for _, _, m in multi])
            plen = np.concatenate([m[1] for _, _, m in multi])
            last = np.concatenate([m[2] for _, _, m in multi])
            word_row = np.concatenate([np.full(m[1].size, r) for r, _, m in multi])
            word_slot = np.concatenate([np.full(m[1].size, s) for _, s, m in multi])
            # the output's last plen tokens, right-aligned at the column plen - 1 of each word
            col = np.arange(width)
            pos = seq_len[word_slot][:, None] - plen[:, None] + col[None, :]
            inside = col[None, :] < plen[:, None]
            tail = tokens[word_slot[:, None], np.clip(pos, 0, tokens.shape[1] - 1)]
            hit = ((tail == prefix) | ~inside).all(1) & (out_len[word_slot] >= plen)
            if hit.any():
                parts_r.append(word_row[hit])
                parts_t.append(last[hit])
        if not parts_r:
            return None, None
        return np.concatenate(parts_r), np.concatenate(parts_t)

    def _penalties(self, rows: np.ndarray, slots: np.ndarray, dev: torch.device) -> Penalties:
        pool = torch.from_numpy(self.pen_row[slots]).to(self.device)
        counts = self.counts[pool]
        rep, pres, freq = self.repetition[slots], self.presence[slots], self.frequency[slots]
        seen = None
        if (rep != 1.0).any():
            seen = self.seen[pool] | (counts > 0)
        return Penalties(
            rows=_tensor(rows, dev), counts=counts.to(dev), seen=None if seen is None else seen.to(dev),
            repetition=torch.from_numpy(rep).to(dev) if seen is not None else None,
            presence=torch.from_numpy(pres).to(dev) if (pres != 0).any() else None,
            frequency=torch.from_numpy(freq).to(dev) if (freq != 0).any() else None,
        )


def _tensor(a: np.ndarray, dev: torch.device) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev)
