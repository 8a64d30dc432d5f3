"""What a decode step costs by the tokens it carries, and how many proposed tokens to verify.

A verify step carries each row's last token plus its proposed tokens. Where the forward reads
its weights anyway (a few rows: the step is bound by memory traffic, not arithmetic), extra
tokens cost little; past that point each costs its share of the matmuls. Where that point lies
depends on the model and the machine (a CPU reaches it at ~10-20 tokens, a GPU at hundreds), so
it is measured: every decode step of the engine (plain or verify) records its wall time by its
token count, and a step of n tokens is estimated from those records.

Choosing: with R rows and proposals whose estimated chances of being kept are g_1 >= g_2 >= ...,
verifying the best k of them yields R + g_1 + ... + g_k tokens in a step of R + k tokens; take the
k that maximises tokens per second (k = 0: decode plainly).
"""

from __future__ import annotations

import numpy as np

# Each token count keeps its last WINDOW step times and is estimated by their median: steps drift
# as contexts grow, and another process taking the cores makes some steps many times slower
# (seen: 3 s for a 100 ms step), which a mean would carry for many steps.
WINDOW = 9


class StepCosts:
    """Estimated wall time of a decode step by its token count, 1 .. `max_tokens`.

    `measured=False` takes every step up to `max_tokens` as costing the same (a forward with room
    to spare: a GPU's tail), which makes the choice independent of timing (the engine's tests).

    Estimates: a token count's median where it has records; between records, linear; below the
    smallest, that one's; above the largest, the largest's (optimistic: untried sizes get tried,
    and then they are measured). Then nondecreasing in n from above: n's estimate is the least of
    its own and every larger count's (more tokens never cost less; noise only ever adds time, so a
    slow outlier at one count must not raise the counts above it).
    """

    def __init__(self, max_tokens: int, measured: bool = True) -> None:
        self.max_tokens = max_tokens
        self.measured = measured
        self._times = np.full((max_tokens + 1, WINDOW), np.nan, dtype=np.float64)
        self._next = np.zeros(max_tokens + 1, dtype=np.int64)  # per count: the ring slot written next

    def record(self, tokens: int, seconds: float) -> None:
        if not self.measured or not 1 <= tokens <= self.max_tokens:
            return
        self._times[tokens, self._next[tokens] % WINDOW] = seconds
        self._next[tokens] += 1

    def estimates(self) -> np.ndarray:
        """Estimated seconds for 0 .. max_tokens tokens (index 0 unused); all ones when nothing is
        measured yet or `measured` is False."""
        known = np.flatnonzero(self._next)
        if not self.measured or known.size == 0:
            return np.ones(self.max_tokens + 1, dtype=np.float64)
        medians = np.nanmedian(self._times[known], axis=1)
        n = np.arange(self.max_tokens + 1)
        return np.minimum.accumulate(np.interp(n, known, medians)[::-1])[::-1]

    def best_extra(self, rows: int, chances: np.ndarray) -> int:
        """How many of the proposals (`chances`, best first) to verify with `rows` rows; at most
        `max_tokens - rows`."""
        k_max = min(chances.size, self.max_tokens - rows)
        if k_max <= 0:
            return 0
        seconds = self.estimates()[rows : rows + k_max + 1]
        tokens = rows + np.concatenate(([0.0], np.cumsum(chances[:k_max])))
        rate = tokens / seconds
        return int(np.argmax(rate))  # NOTE: ties go to fewer tokens (first maximum)
