"""Leases: which clients of the server are still alive, since a ZMQ ROUTER sees no disconnects.

Every message from a peer (a ROUTER identity) renews its lease; a `Heartbeat` may also set how
long the lease lasts (`lease_s`), which then holds for that peer's later renewals, capped at the
service's `max_s` (clamped, not refused: a client that asks an hour and vanishes holds its blocks
for `max_s` at most). A peer silent for longer than its lease has expired: the server aborts its
requests and frees their blocks.
Pure bookkeeping with the clock passed in, so it is tested without sockets or sleeps.
"""

from __future__ import annotations

import heapq
import math
from typing import Optional


class Leases:
    """Deadline per peer.

    Invariants: a peer is either live (in `_deadline`) or forgotten; every live peer has an entry
    in the heap no later than its deadline (renewals only push when the deadline moves earlier,
    and an entry found early is pushed again with the current deadline), so `expired(now)`
    returns each live peer whose deadline is <= now, exactly once, and forgets it.
    """

    def __init__(self, default_s: float, max_s: float = math.inf) -> None:
        if not default_s > 0:
            raise ValueError(f"Leases.default_s must be > 0, got {default_s!r}")
        if not max_s >= default_s:
            raise ValueError(f"Leases.max_s must be >= default_s ({default_s!r}), got {max_s!r}")
        self.default_s, self.max_s = default_s, max_s
        self._deadline: dict[bytes, float] = {}
        self._length: dict[bytes, float] = {}  # a peer's own lease length, from its heartbeats, <= max_s
        self._heap: list[tuple[float, bytes]] = []

    def renew(self, peer: bytes, now: float, lease_s: Optional[float] = None) -> bool:
        """`peer` was heard from at `now`; `lease_s` (a heartbeat's) replaces its lease length, cut
        to `max_s`. True when this cut a length the peer had not been cut to before (worth a log)."""
        cut = False
        if lease_s is not None:
            granted = min(lease_s, self.max_s)
            cut = granted < lease_s and self._length.get(peer) != granted
            self._length[peer] = granted
        deadline = now + self._length.get(peer, self.default_s)
        old = self._deadline.get(peer)
        self._deadline[peer] = deadline
        if old is None or deadline < old:
            heapq.heappush(self._heap, (deadline, peer))
        return cut

    def expired(self, now: float) -> list[bytes]:
        """The live peers whose lease ran out by `now` (each reported once, then forgotten)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, peer = heapq.heappop(self._heap)
            deadline = self._deadline.get(peer)
            if deadline is None:
                continue  # a stale entry of a peer already expired or forgotten
            if deadline <= now:
                out.append(peer)
                self.forget(peer)
            else:  # renewed since this entry was pushed
                heapq.heappush(self._heap, (deadline, peer))
        return out

    def next_deadline(self) -> Optional[float]:
        """When `expired` may next have something to say (None: no live peer)."""
        return self._heap[0][0] if self._heap else None

    def forget(self, peer: bytes) -> None:
        self._deadline.pop(peer, None)
        self._length.pop(peer, None)

    def is_live(self, peer: bytes) -> bool:
        return peer in self._deadline

    def __len__(self) -> int:
        return len(self._deadline)
