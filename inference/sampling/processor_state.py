"""Each slot's logit-processor state, kept incrementally, and the step inputs built from it.

The context is the one writer: `bind` when a request takes a slot (its prompt and the output it
already has, after a preemption), `append` with each step's sampled tokens, `release` when it
leaves. Every processor's per-slot data lives in flat tables of entries tagged by slot
(`_Entries`), so a step selects its rows' entries with one vectorised gather through a
slot -> batch-row map: no Python per row, whatever the batch size.

Penalties keep one entry per (slot, token) seen (the prompt's distinct tokens, then each output
token the first time it is sampled) with its output count, +1 per sampled token, found through a
dense `[pool rows, V]` index held by penalised slots only; never recounted from the tokens.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from inference.sampling.params import SamplingParams
from inference.sampling.processors import Penalties, StepProcessors

_NONE = -1


class _Entries:
    """A table of per-slot entries: column arrays of one length, `slot` tagging each entry.

    Entries are added with their slot's `bind` and dropped at its `release`; 2-D columns (bad-word
    prefixes) are padded with -1 to the widest entry."""

    __slots__ = ("slot", "cols")

    def __init__(self, **cols: np.ndarray) -> None:
        self.slot = np.empty(0, dtype=np.int64)
        self.cols = cols

    def add(self, slot: int, **cols: np.ndarray) -> None:
        count = len(next(iter(cols.values())))
        self.slot = np.concatenate((self.slot, np.full(count, slot, dtype=np.int64)))
        for name, new in cols.items():
            old = self.cols[name]
            if new.ndim == 2 and new.shape[1] != old.shape[1]:
                width = max(new.shape[1], old.shape[1])
                old = np.pad(old, ((0, 0), (0, width - old.shape[1])), constant_values=-1)
                new = np.pad(new, ((0, 0), (0, width - new.shape[1])), constant_values=-1)
            self.cols[name] = np.concatenate((old, new.astype(old.dtype, copy=False)))

    def drop(self, slot: int) -> np.ndarray:
        """Remove `slot`'s entries; returns the mask of the entries kept (to remap indices)."""
        keep = self.slot != slot
        self.slot = self.slot[keep]
        for name, col in self.cols.items():
            self.cols[name] = col[keep]
        return keep

    def select(self, to_batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(batch row of each selected entry, the selected entries' indices) for the slots mapped."""
        rows = to_batch[self.slot]
        index = np.flatnonzero(rows >= 0)
        return rows[index], index


class ProcessorState:
    """Per-slot processor state for `slots` slots over a `vocab_size` vocabulary.

    Invariants: `uses[s]` iff slot s is bound to a request with `uses_processors`, and only such a
    slot has entries; a slot with penalties owns pool row `pen_row[s]` (no other slot does) and
    `pair_of[pen_row[s], t]` is the index in `pairs` of its (s, t) entry or -1; that entry's count
    is the number of times s's output holds t.
    """

    __slots__ = ("vocab_size", "eos_token_ids", "device", "uses", "bias", "allowed", "bans", "words", "stops",
                 "pairs", "pen_row", "repetition", "presence", "frequency", "pair_of", "_free_rows")

    def __init__(self, slots: int, vocab_size: int, eos_token_ids=(), device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = np.asarray(sorted(eos_token_ids), dtype=np.int64)
        self.device = torch.device(device)
        self.uses = np.zeros(slots, dtype=bool)
        i64, f32 = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32)
        self.bias = _Entries(token=i64, value=f32)
        self.allowed = _Entries(token=i64)
        self.bans = _Entries(token=i64)  # always banned: 1-token bad words
        self.words = _Entries(prefix=np.empty((0, 1), dtype=np.int64), length=i64, last=i64)  # longer bad words
        self.stops = _Entries(token=i64, until=i64)  # banned while the output is shorter than `until`
        self.pairs = _Entries(token=i64, count=np.empty(0, dtype=np.int32))
        self.pen_row = np.full(slots, _NONE, dtype=np.int64)
        self.repetition = np.ones(slots, dtype=np.float32)
        self.presence = np.zeros(slots, dtype=np.float32)
        self.frequency = np.zeros(slots, dtype=np.float32)
        self.pair_of = np.full((0, vocab_size), _NONE, dtype=np.int32)
        self._free_rows: list[int] = []

    # ---- the writer's calls ------------------------------------------------------------------

    def bind(self, slot: int, p: SamplingParams, prompt: np.ndarray, output: np.ndarray) -> None:
        """Slot `slot` now serves a request with params `p`, prompt and output token ids so far."""
        self.release(slot)
        if not p.uses_processors:
            return
        self.uses[slot] = True
        if p.logit_bias:
            self.bias.add(slot, token=np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias)),
                          value=np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias)))
        if p.allowed_token_ids is not None:
            self.allowed.add(slot, token=np.unique(np.asarray(p.allowed_token_ids, dtype=np.int64)))
        if p.bad_words_token_ids:
            single = [w[0] for w in p.bad_words_token_ids if len(w) == 1]
            multi = [w for w in p.bad_words_token_ids if len(w) > 1]
            if single:
                self.bans.add(slot, token=np.asarray(single, dtype=np.int64))
            if multi:
                prefix = np.full((len(multi), max(len(w) for w in multi) - 1), -1, dtype=np.int64)
                for i, w in enumerate(multi):
                    prefix[i, : len(w) - 1] = w[:-1]
                self.words.add(slot, prefix=prefix, length=np.array([len(w) - 1 for w in multi], dtype=np.int64),
                               last=np.array([w[-1] for w in multi], dtype=np.int64))
        if p.min_tokens > 0:
            # NOTE: as vLLM: EOS counts as a stop (so is banned) unless the request ignores it
            stops = p.stop_token_ids if p.ignore_eos else [*p.stop_token_ids, *self.eos_token_ids.tolist()]
            if stops:
                token = np.unique(np.asarray(stops, dtype=np.int64))
                self.stops.add(slot, token=token, until=np.full(token.size, p.min_tokens, dtype=np.int64))
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            self._bind_penalties(slot, p, prompt, output)

    def _bind_penalties(self, slot: int, p: SamplingParams, prompt: np.ndarray, output: np.ndarray) -> None:
        row = self._take_row()
        self.pen_row[slot] = row
        self.repetition[slot] = p.repetition_penalty
        self.presence[slot] = p.presence_penalty
        self.frequency[slot] = p.frequency_penalty
        output = np.asarray(output, dtype=np.int64)
        # NOTE: the prompt's tokens matter to the repetition penalty only; with count 0 they move nothing else
        seen = np.unique(np.concatenate((np.asarray(prompt, dtype=np.int64) if p.repetition_penalty != 1.0
                                         else output[:0], output)))
        counts = np.bincount(output, minlength=self.vocab_size)[seen].astype(np.int32)
        start = self.pairs.slot.size
        self.pairs.add(slot, token=seen, count=counts)
        self.pair_of[row, seen] = np.arange(start, start + seen.size, dtype=np.int32)

    def append(self, slots: np.ndarray, tokens: np.ndarray) -> None:
        """Each of `slots` sampled the matching token of `tokens` (one step's, slots distinct)."""
        if not self.uses.any():  # NOTE: one pass over a few hundred flags; the usual step has no processor
            return
        rows = self.pen_row[slots]
        mine = np.flatnonzero(rows != _NONE)
        if mine.size == 0:
            return
        rows, toks, owners = rows[mine], np.asarray(tokens, dtype=np.int64)[mine], np.asarray(slots)[mine]
        index = self.pair_of[rows, toks].astype(np.int64)
        new = index == _NONE
        if new.any():
            start = self.pairs.slot.size
            fresh = np.arange(start, start + int(new.sum()), dtype=np.int64)
            self.pairs.slot = np.concatenate((self.pairs.slot, owners[new]))
            self.pairs.cols["token"] = np.concatenate((self.pairs.cols["token"], toks[new]))
            self.pairs.cols["count"] = np.concatenate((self.pairs.cols["count"], np.zeros(fresh.size, np.int32)))
            self.pair_of[rows[new], toks[new]] = fresh
            index[new] = fresh
        self.pairs.cols["count"][index] += 1

    def release(self, slot: int) -> None:
        """Forget `slot`'s state (its request left the slot)."""
        if not self.uses[slot]:
            return
        self.uses[slot] = False
        for table in (self.bias, self.allowed, self.bans, self.words, self.stops):
            table.drop(slot)
        row = int(self.pen_row[slot])
        if row != _NONE:
            self.pair_of[row] = _NONE
            kept = self.pairs.drop(slot)
            if not kept.all():  # the entries after the dropped ones moved down: re-index them
                owners = self.pen_row[self.pairs.slot]
                self.pair_of[owners, self.pairs.cols["token"]] = np.arange(self.pairs.slot.size, dtype=np.int32)
            self._free_rows.append(row)
            self.pen_row[slot] = _NONE
            self.repetition[slot], self.presence[slot], self.frequency[slot] = 1.0, 0.0, 0.0

    def reset(self) -> None:
        for slot in np.flatnonzero(self.uses).tolist():
            self.release(slot)

    def _take_row(self) -> int:
        if not self._free_rows:  # grow the pool by doubling; a free row is all -1
            old = self.pair_of.shape[0]
            new = max(4, 2 * old)
            self.pair_of = np.concatenate((self.pair_of, np.full((new - old, self.vocab_size), _NONE, np.int32)))
            self._free_rows.extend(range(new - 1, old - 1, -1))
        return self._free_rows.pop()

    def output_counts(self, slot: int) -> dict[int, int]:
        """{token: output count} of a penalised slot's seen tokens (for tests and debugging)."""
        mine = self.pairs.slot == slot
        return dict(zip(self.pairs.cols["token"][mine].tolist(), self.pairs.cols["count"][mine].tolist()))

    # ---- one step's inputs -------------------------------------------------------------------

    def for_rows(self, slots: np.ndarray, tokens: np.ndarray, seq_len: np.ndarray, prompt_len: np.ndarray,
                 device: torch.device | str | None = None) -> StepProcessors | None:
        """The processor inputs of a step sampling `slots` (row i = slot slots[i]); None when no row
        uses a processor. `tokens [slots, length]`, `seq_len`, `prompt_len`: the context's arrays."""
        if not self.uses[slots].any():
            return None
        dev = self.device if device is None else torch.device(device)
        to_batch = np.full(self.uses.size, _NONE, dtype=np.int64)
        to_batch[slots] = np.arange(slots.size)
        out = StepProcessors()
        rows, index = self.bias.select(to_batch)
        if rows.size:
            out.bias_rows, out.bias_ids = _tensor(rows, dev), _tensor(self.bias.cols["token"][index], dev)
            out.bias_values = torch.from_numpy(self.bias.cols["value"][index]).to(dev)
        rows, index = self.allowed.select(to_batch)
        if rows.size:
            out.allowed_rows = _tensor(np.unique(rows), dev)
            out.allowed_entry_rows = _tensor(rows, dev)
            out.allowed_ids = _tensor(self.allowed.cols["token"][index], dev)
        ban_rows, ban_ids = self._bans(to_batch, tokens, seq_len, prompt_len)
        if ban_rows.size:
            out.ban_rows, out.ban_ids = _tensor(ban_rows, dev), _tensor(ban_ids, dev)
        rows, index = self.pairs.select(to_batch)
        if rows.size:
            out.penalties = self._penalties(rows, index, dev)
        return out

    def _bans(self, to_batch: np.ndarray, tokens: np.ndarray, seq_len: np.ndarray,
              prompt_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out_len = seq_len - prompt_len  # per slot, tokens generated so far
        rows, index = self.bans.select(to_batch)
        parts_r, parts_t = [rows], [self.bans.cols["token"][index]]
        rows, index = self.stops.select(to_batch)
        under = out_len[self.stops.slot[index]] < self.stops.cols["until"][index]
        parts_r.append(rows[under])
        parts_t.append(self.stops.cols["token"][index][under])
        rows, index = self.words.select(to_batch)
        if rows.size:
            prefix, plen = self.words.cols["prefix"][index], self.words.cols["length"][index]
            owner = self.words.slot[index]
            # the output's last plen tokens, in the first plen columns
            col = np.arange(prefix.shape[1])
            pos = seq_len[owner][:, None] - plen[:, None] + col[None, :]
            tail = tokens[owner[:, None], np.clip(pos, 0, tokens.shape[1] - 1)]
            hit = ((tail == prefix) | (col[None, :] >= plen[:, None])).all(1) & (out_len[owner] >= plen)
            parts_r.append(rows[hit])
            parts_t.append(self.words.cols["last"][index][hit])
        return np.concatenate(parts_r), np.concatenate(parts_t)

    def _penalties(self, rows: np.ndarray, index: np.ndarray, dev: torch.device) -> Penalties:
        owner = self.pairs.slot[index]
        rep, pres, freq = self.repetition[owner], self.presence[owner], self.frequency[owner]
        return Penalties(
            rows=_tensor(rows, dev), ids=_tensor(self.pairs.cols["token"][index], dev),
            counts=torch.from_numpy(self.pairs.cols["count"][index].astype(np.float32)).to(dev),
            repetition=torch.from_numpy(rep).to(dev) if (rep != 1.0).any() else None,
            presence=torch.from_numpy(pres).to(dev) if (pres != 0).any() else None,
            frequency=torch.from_numpy(freq).to(dev) if (freq != 0).any() else None,
        )


def _tensor(a: np.ndarray, dev: torch.device) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev)
