"""ServiceMetrics: what the rollout server counts, merged with the engine's figures for `Stats`.

Counted on the server's socket thread (single writer): requests, samples and tokens sent, tokens
per policy version, pauses / suspends / weight updates, lease expiries, errors by code. Tokens
per second are over a sliding window. `snapshot` merges the engine's `stats()` and renames the
figures an RL dashboard wants under stable keys (`SERVICE_KEYS`).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any, Optional, Union

import numpy as np

from rollout.wire.kinds import ErrorCode

StatValue = Union[int, float, str]

# the headline figures, by key (see `snapshot`): what `rollout.rl.tracking` logs and prints
SERVICE_KEYS = ("tokens_per_s", "queue_depth", "requests_in_flight", "kv_utilization", "prefix_hit_rate", "pauses",
                "evictions", "policy_version")


class ServiceMetrics:
    """Counters of one server process (see module docstring)."""

    def __init__(self, window_s: float = 10.0, clock=time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self.started = clock()
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.tokens_by_version: Counter[int] = Counter()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of samples sent
        self._recent_tokens = 0

    def count(self, name: str, k: int = 1) -> None:
        self.counts[name] += k

    def error(self, code: ErrorCode) -> None:
        self.errors[ErrorCode(code).name] += 1

    def sample_sent(self, versions: np.ndarray) -> None:
        """A finished sample went out: its tokens count, per the version that sampled each."""
        n = int(versions.size)
        self.counts["samples_sent"] += 1
        self.counts["tokens_sent"] += n
        if n:
            values, counts = np.unique(versions, return_counts=True)
            for v, c in zip(values.tolist(), counts.tolist()):
                self.tokens_by_version[v] += c
            now = self._clock()
            self._recent.append((now, n))
            self._recent_tokens += n
            self._trim(now)

    def tokens_per_s(self) -> float:
        now = self._clock()
        self._trim(now)
        span = min(self.window_s, max(now - self.started, 1e-9))
        return self._recent_tokens / span

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent_tokens -= self._recent.popleft()[1]

    def snapshot(self, engine_stats: Mapping[str, Any], *, held: int = 0, requests_in_flight: int = 0,
                 clients: int = 0, extra: Optional[Mapping[str, Any]] = None) -> dict[str, StatValue]:
        """Wire-ready stats: the engine's figures (None dropped, bools as ints), this server's
        counters, and the headline keys of `SERVICE_KEYS`."""
        out: dict[str, StatValue] = {f"engine/{k}": v for k, v in _wire_values(engine_stats).items()}
        out.update({k: int(v) for k, v in self.counts.items()})
        out.update({f"errors/{k}": int(v) for k, v in self.errors.items()})
        out.update({f"tokens_v{v}": int(c) for v, c in sorted(self.tokens_by_version.items())})
        waiting = int(engine_stats.get("waiting", 0) or 0)
        out.update(
            tokens_per_s=float(self.tokens_per_s()),
            queue_depth=waiting + held,  # held: requests a front holds before the engine (or a replica) has them
            requests_in_flight=requests_in_flight,
            clients=clients,
            kv_utilization=float(engine_stats.get("kv_utilization", engine_stats.get("allocated_utilization", 0.0))),
            prefix_hit_rate=float(engine_stats.get("prefix_hit_rate", 0.0) or 0.0),
            pauses=int(self.counts.get("pauses", 0)),
            evictions=int(engine_stats.get("preemptions", 0) or 0),
            policy_version=int(engine_stats.get("policy_version", 0) or 0),
            uptime_s=float(self._clock() - self.started),
        )
        if extra:
            out.update(_wire_values(extra))
        return out


def _wire_values(stats: Mapping[str, Any]) -> dict[str, StatValue]:
    """Values the `Result.stats` schema takes: int, float or str (None dropped, bool as int)."""
    out: dict[str, StatValue] = {}
    for key, value in stats.items():
        if value is None:
            continue
        if isinstance(value, (bool, np.bool_)):
            out[str(key)] = int(value)
        elif isinstance(value, (int, np.integer)):
            out[str(key)] = int(value)
        elif isinstance(value, (float, np.floating)):
            out[str(key)] = float(value)
        else:
            out[str(key)] = str(value)
    return out
