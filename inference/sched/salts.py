"""Who still uses each salted version: live requests and sessions, by the version they started with.

Under the SALTED prefix-cache policy a request's blocks are keyed by its start version: its
group's, or for a turn of a known session the session's. A version's blocks are worth keeping
while a live request or a session is salted with it; once none is, they are the first to evict.
Torch-free bookkeeping, owned by the `Scheduler` (the one writer of live requests).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Optional


class SaltBook:
    """Live users per salt version.

    Invariants: `_requests[v]` counts the live salted requests keyed by version v (each counted
    once, from `acquire` to `release`); `_sessions` maps every remembered session to its start
    version, at most `max_sessions` of them (least recently used dropped first), and only salted ones
    make their version live (a RESET session's start is kept for `max_staleness`); `stale` holds
    the sessions refused for staleness (StalePolicy.ABORT) until they end.
    """

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._requests: Counter[int] = Counter()
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._session_counts: Counter[int] = Counter()  # salted sessions per start version
        self._salted: set[str] = set()  # sessions whose turns are keyed by their start version
        self.stale: set[str] = set()

    def session_version(self, session_id: str) -> Optional[int]:
        """The start version of a remembered session (None: new or forgotten), marked used now."""
        version = self._sessions.get(session_id)
        if version is not None:
            self._sessions.move_to_end(session_id)
        return version

    def start_session(self, session_id: str, version: int, salted: Optional[bool] = None) -> list[int]:
        """Remember a session under `version` (`salted`: its blocks are keyed by it; None: as it was);
        returns the versions whose last user the LRU bound dropped."""
        salted = session_id in self._salted if salted is None else salted
        self._forget(session_id)
        self._sessions[session_id] = version
        if salted:
            self._salted.add(session_id)
            self._session_counts[version] += 1
        dropped = []
        while len(self._sessions) > self.max_sessions:
            oldest = next(iter(self._sessions))
            dropped.append(self._forget(oldest))
            self.stale.discard(oldest)
        return [v for v in dropped if not self.in_use(v)]

    def _forget(self, session_id: str) -> Optional[int]:
        version = self._sessions.pop(session_id, None)
        if version is not None and session_id in self._salted:
            self._salted.discard(session_id)
            self._session_counts[version] -= 1
            if not self._session_counts[version]:
                del self._session_counts[version]
        return version

    def end_session(self, session_id: str) -> Optional[int]:
        """Forget a session; its version if that was its last user, else None."""
        self.stale.discard(session_id)
        version = self._forget(session_id)
        return version if version is not None and not self.in_use(version) else None

    def mark_stale(self, session_id: str) -> None:
        """Refuse the session's next turns (it is too stale to go on); bounded like the sessions."""
        self.stale.add(session_id)
        if len(self.stale) > self.max_sessions:
            self.stale.pop()

    def acquire(self, version: int) -> None:
        self._requests[version] += 1

    def release(self, version: int) -> Optional[int]:
        """A salted request keyed by `version` finished: `version` if it had no other user."""
        left = self._requests[version] - 1
        if left > 0:
            self._requests[version] = left
            return None
        del self._requests[version]
        return None if self.in_use(version) else version

    def in_use(self, version: int) -> bool:
        return version in self._requests or version in self._session_counts

    def live_versions(self) -> set[int]:
        """Versions some live request or remembered session is salted with."""
        return set(self._requests) | set(self._session_counts)

    def sessions_before(self, version: int) -> list[str]:
        """Sessions whose start version is older than `version`."""
        return [sid for sid, v in self._sessions.items() if v < version]

    def session_count(self) -> int:
        return len(self._sessions)
