"""N-gram proposals: continue a request's suffix where it occurred before in a corpus of tokens.

The corpus is the concatenation of token sequences (a group's siblings, earlier samples of the
prompt, the request's own tokens) separated by `SEP`, which no token equals, so no match and no
continuation crosses from one sequence into the next.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SEP = -1  # between the corpus's sequences (token ids are >= 0)


def build_corpus(sequences: Sequence[np.ndarray]) -> np.ndarray:
    """The sequences joined by `SEP` (the last one is usually the request's own tokens)."""
    parts: list[np.ndarray] = []
    sep = np.full(1, SEP, dtype=np.int64)
    for seq in sequences:
        if parts:
            parts.append(sep)
        parts.append(np.asarray(seq, dtype=np.int64))
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def propose(suffix: np.ndarray, corpus: np.ndarray, num_tokens: int, min_match: int, max_match: int) -> np.ndarray:
    """Up to `num_tokens` tokens that followed the longest match (at least `min_match`, at most
    `max_match` tokens) of the end of `suffix` in `corpus`; ties go to the latest match. Empty when
    nothing matches. A match that ends the corpus has no continuation and is never taken."""
    if suffix.size < min_match or corpus.size <= min_match or num_tokens < 1:
        return corpus[:0]
    key = suffix[-min_match:]
    windows = np.lib.stride_tricks.sliding_window_view(corpus[:-1], min_match)
    hits = np.flatnonzero((windows == key).all(axis=1)) + (min_match - 1)  # index of each match's last token
    hits = hits[corpus[hits + 1] != SEP]
    if hits.size == 0:
        return corpus[:0]
    # extend each match backwards while it agrees with the suffix, up to max_match tokens
    length = np.full(hits.size, min_match, dtype=np.int64)
    alive = np.ones(hits.size, dtype=bool)
    for extra in range(min_match, min(max_match, suffix.size)):
        at = hits - extra
        ok = alive & (at >= 0)
        ok[ok] = corpus[at[ok]] == suffix[-1 - extra]
        length += ok
        alive = ok
        if not alive.any():
            break
    best = hits[np.flatnonzero(length == length.max())[-1]]
    follow = corpus[best + 1 : best + 1 + num_tokens]
    stop = np.flatnonzero(follow == SEP)
    return follow[: stop[0]] if stop.size else follow
