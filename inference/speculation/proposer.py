"""N-gram proposals: continue a request's suffix the way its matches in a corpus continued.

The corpus is the concatenation of token sequences (a group's siblings, earlier samples of the
prompt, the request's own tokens) separated by `SEP`, which no token equals, so no match and no
continuation crosses from one sequence into the next.

Why a vote: the corpus holds samples of the same policy for the same prompt, so among the places
where the request's current context occurred, the share that continued with token t estimates
the policy's probability of t there, and that probability is the chance the verify step keeps a
proposed t (a proposal is kept exactly when the target samples it). So each proposed token is the
most frequent continuation, and its estimated chance of being kept rides along with it: the
engine spends forward rows on the proposals most likely to pay (core/speculative_step.py).
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


def longest_matches(suffix: np.ndarray, corpus: np.ndarray, min_match: int, max_match: int) -> np.ndarray:
    """Corpus positions (ascending) where the longest match of the end of `suffix` ends, the match
    at least `min_match` and at most `max_match` tokens, counting only matches that have a
    continuation (the next token exists and is not `SEP`). Empty when nothing matches."""
    if suffix.size < min_match or corpus.size <= min_match:
        return corpus[:0]
    key = suffix[-min_match:]
    windows = np.lib.stride_tricks.sliding_window_view(corpus[:-1], min_match)
    hits = np.flatnonzero((windows == key).all(axis=1)) + (min_match - 1)  # index of each match's last token
    hits = hits[corpus[hits + 1] != SEP]
    if hits.size == 0:
        return hits
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
    return hits[length == length.max()]


def propose(suffix: np.ndarray, corpus: np.ndarray, num_tokens: int, min_match: int, max_match: int,
            min_chance: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Up to `num_tokens` proposed tokens and, for each, its estimated chance of being kept (that
    it and every proposal before it are the target's samples).

    From the longest matches of `suffix` (`longest_matches`), each step proposes the continuation
    most of the live matches have (a tie goes to the latest match's), with chance multiplied by
    `votes / (live matches + 1)` (one pseudo-count against: a single match is no certainty), and
    keeps walking only the matches that continued with it. Stops when no match continues or the
    chance would drop below `min_chance`."""
    cand = longest_matches(suffix, corpus, min_match, max_match) if num_tokens >= 1 else corpus[:0]
    tokens: list[int] = []
    chances: list[float] = []
    chance = 1.0
    while cand.size and len(tokens) < num_tokens:
        nxt = corpus[cand + 1]
        values, counts = np.unique(nxt, return_counts=True)
        top = counts.max()
        tied = values[counts == top]
        token = int(tied[0]) if tied.size == 1 else int(nxt[np.flatnonzero(np.isin(nxt, tied))[-1]])
        chance *= top / (cand.size + 1)
        if chance < min_chance:
            break
        tokens.append(token)
        chances.append(chance)
        cand = cand[nxt == token] + 1
        cand = cand[cand + 1 < corpus.size]
        cand = cand[corpus[cand + 1] != SEP]
    return np.array(tokens, dtype=np.int64), np.array(chances, dtype=np.float64)
