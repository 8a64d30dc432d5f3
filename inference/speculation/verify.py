"""Exact-match verification of proposed tokens against the target's own samples.

A verify step samples the target at every position of a request's query (its last token, then
its proposed tokens), each position with the randomness it would have had without speculation
(a seeded row's generator gives position p its p-th uniform; see core/speculative_step.py). A
proposed token is kept exactly when it equals the target's sample at its position; the sample at
the first mismatch (or after the last proposal) is kept too. So the kept tokens are the tokens
the target would have sampled one step at a time: lossless by construction, for any sampler.
"""

from __future__ import annotations

import numpy as np


def accepted_counts(sampled: np.ndarray, drafts: list[np.ndarray], starts: np.ndarray) -> np.ndarray:
    """Per request b, the leading proposed tokens `drafts[b]` equal to the target's samples at
    their positions: `sampled[starts[b] + i] == drafts[b][i]` for i < the count (rows of request b
    are `starts[b] .. starts[b] + len(drafts[b])`)."""
    counts = np.zeros(len(drafts), dtype=np.int64)
    for b, draft in enumerate(drafts):
        if draft.size:
            same = sampled[starts[b] : starts[b] + draft.size] == draft
            counts[b] = draft.size if same.all() else int(np.argmin(same))
    return counts


def cut_at_stops(emitted: np.ndarray, is_stop: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Shorten each request's kept tokens to end at its first stop token (`is_stop` per row)."""
    out = emitted.copy()
    for b in range(emitted.size):
        stops = np.flatnonzero(is_stop[starts[b] : starts[b] + emitted[b]])
        if stops.size:
            out[b] = stops[0] + 1
    return out
