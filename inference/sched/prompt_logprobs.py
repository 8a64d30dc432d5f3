"""A request's prompt log-probs by token position, and their exchange with the prefix cache.

Position `t` holds the raw log-prob of prompt token `t` under the logits of position `t - 1`,
its rank in the vocabulary there (vLLM's: the entries whose log-prob is >= its own, so 1 = most
likely and a tie counts ahead) and the top-n alternatives there; position 0 (the first prompt
token) has none. A cached KV block carries the same scores as a `PromptLogprobsBlock` (the
seed's layout): slot `i` of block `k` holds the logits of token `k * bs + i`, i.e. the scores of
token `k * bs + i + 1`. Its last slot scores the first token of the next block, which the
block's hash does not cover, so it applies only to a request whose next token is the recorded
`next_token_id`.

A request that asks for prompt log-probs matches a cached block only if the block carries every
score the request needs from it, with at least its top-n: it never gets partial data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from inference.kv_cache.block_state import MAX_CACHED_PROMPT_TOP_N_LOGPROBS, PromptLogprobsBlock

if TYPE_CHECKING:
    from inference.kv_cache.allocator import KVBlockAllocator


def block_targets(block_index: int, block_size: int, prompt_len: int) -> tuple[int, int]:
    """Prompt positions `[lo, hi)` that the slots of block `block_index` score, in slot order."""
    lo = block_index * block_size + 1
    return lo, max(lo, min((block_index + 1) * block_size + 1, prompt_len))


def block_serves(block: Optional[PromptLogprobsBlock], block_index: int, block_size: int,
                 prompt: Sequence[int], top_n: int) -> bool:
    """Whether cached `block`, at `block_index` of `prompt`, holds every score a request asking
    for `top_n` alternatives needs from it (a block past the prompt needs none)."""
    lo, hi = block_targets(block_index, block_size, len(prompt))
    if hi == lo:
        return True
    if block is None or block.top_n < top_n or not bool(block.valid[: hi - lo].all()):
        return False
    # NOTE: the last slot scores the next block's first token, which the block's hash does not cover
    return hi - lo < block_size or block.next_token_id == prompt[hi - 1]


def servable_prefix(pool: KVBlockAllocator, hashes: list[int], prompt: Sequence[int], top_n: int) -> list[int]:
    """The leading `hashes` whose cached blocks carry every prompt score a request asking for
    `top_n` alternatives needs (it must not take a block it would have to score again)."""
    usable = 0
    for index, block_id in enumerate(pool.cached_prefix(hashes)):
        if not block_serves(pool.prompt_logprobs_of(block_id), index, pool.block_size, prompt, top_n):
            break
        usable += 1
    return hashes[:usable]


class PromptScores:
    """Scores of one admission of a request (see module docstring).

    Invariant: `known[t]` iff position `t` was scored in this admission, by a forward pass of the
    current weights or by a cached block matched under the current version. A request that
    leaves its slot to be recomputed starts over with fresh scores.
    """

    __slots__ = ("top_n", "logprobs", "top_logprobs", "top_ids", "ranks", "known")

    def __init__(self, prompt_len: int, top_n: int) -> None:
        self.top_n = top_n
        self.logprobs = np.zeros(prompt_len, dtype=np.float32)
        self.top_logprobs = np.zeros((prompt_len, top_n), dtype=np.float32)
        self.top_ids = np.zeros((prompt_len, top_n), dtype=np.int64)
        self.ranks = np.zeros(prompt_len, dtype=np.int64)
        self.known = np.zeros(prompt_len, dtype=bool)

    @classmethod
    def admitted(cls, prompt_len: int, top_n: int, pool: KVBlockAllocator, matched: list[int]) -> PromptScores:
        """Fresh scores of a request entering a slot, with those its matched blocks carry."""
        scores = cls(prompt_len, top_n)
        for index, block_id in enumerate(matched):
            block = pool.prompt_logprobs_of(block_id)
            if block is not None:
                scores.fill_from(block, index, pool.block_size)
        return scores

    @property
    def prompt_len(self) -> int:
        return self.known.size

    def write(self, first: int, logprobs: torch.Tensor, top_logprobs: Optional[torch.Tensor],
              top_ids: Optional[torch.Tensor], ranks: torch.Tensor) -> None:
        """Scores of positions `first ..` computed by a forward pass (overwrites what was there)."""
        end = first + logprobs.shape[0]
        self.logprobs[first:end] = logprobs.cpu().numpy()
        self.ranks[first:end] = ranks.cpu().numpy()
        if self.top_n:
            self.top_logprobs[first:end] = top_logprobs.cpu().numpy()
            self.top_ids[first:end] = top_ids.cpu().numpy()
        self.known[first:end] = True

    # ---- the prefix cache --------------------------------------------------------------------

    def fill_from(self, block: PromptLogprobsBlock, block_index: int, block_size: int) -> int:
        """Copy the scores a matched block carries for this prompt; how many positions it gave."""
        lo, hi = block_targets(block_index, block_size, self.prompt_len)
        count = hi - lo
        if count == 0:
            return 0
        self.logprobs[lo:hi] = block.log_probs[:count].numpy()
        self.ranks[lo:hi] = block.ranks[:count].numpy()
        if self.top_n:
            self.top_logprobs[lo:hi] = block.top_n_log_probs[:count, : self.top_n].numpy()
            self.top_ids[lo:hi] = block.top_n_token_ids[:count, : self.top_n].numpy()
        self.known[lo:hi] = True
        return count

    def to_block(self, block_index: int, block_size: int, tokens: Sequence[int]) -> Optional[PromptLogprobsBlock]:
        """The scores of a block this request just registered, to cache with it; None if it
        scores no prompt token or its top-n is more than the cache keeps."""
        lo, hi = block_targets(block_index, block_size, self.prompt_len)
        if hi == lo or self.top_n > MAX_CACHED_PROMPT_TOP_N_LOGPROBS:
            return None
        count = hi - lo
        block = PromptLogprobsBlock(block_size, self.top_n)
        block.log_probs[:count] = torch.from_numpy(self.logprobs[lo:hi])
        block.ranks[:count] = torch.from_numpy(self.ranks[lo:hi])
        block.top_n_log_probs[:count] = torch.from_numpy(self.top_logprobs[lo:hi])
        block.top_n_token_ids[:count] = torch.from_numpy(self.top_ids[lo:hi])
        block.valid[:count] = torch.from_numpy(self.known[lo:hi])
        if count == block_size:
            block.next_token_id = int(tokens[hi - 1])
        return block

    # ---- output ------------------------------------------------------------------------------

    def ranks_list(self) -> Optional[list[Optional[int]]]:
        """Each prompt token's vocabulary rank, `[None, r1, ...]`; None while a position is
        unscored (as `as_dicts`)."""
        if not bool(self.known[1:].all()):
            return None
        return [None, *self.ranks[1:].tolist()]

    def as_dicts(self, prompt: Sequence[int]) -> Optional[list[Optional[dict[int, float]]]]:
        """`[None, {token: lp, alternative: lp, ...}, ...]`, one entry per prompt token; None while
        a position is unscored (a request aborted mid-prefill): never a list of another length."""
        if not bool(self.known[1:].all()):
            return None
        end = self.prompt_len
        out: list[Optional[dict[int, float]]] = [None]
        lps = self.logprobs[1:end].tolist()
        if not self.top_n:
            out.extend({prompt[t]: lp} for t, lp in zip(range(1, end), lps))
            return out
        ids, tops = self.top_ids[1:end].tolist(), self.top_logprobs[1:end].tolist()
        for t, lp, row_ids, row_tops in zip(range(1, end), lps, ids, tops):
            entry = {prompt[t]: lp}
            entry.update(zip(row_ids, row_tops))
            out.append(entry)
        return out
