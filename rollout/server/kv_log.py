"""KvEventLog: a server's prefix-cache events, numbered, for the routers that poll them (`KvEvents`).

The engine announces which block hashes it can serve (`inference.kv_cache.events`: stored,
removed, all cleared) on its loop thread; the log is a listener there. A router asks for the
events from its cursor on (`read(since)`), on the server's socket thread, which never waits for
the engine. Each router keeps its own cursor, so any number of them can follow one server.

The log is bounded (`capacity` events): a poller that falls further behind, or one whose cursor
belongs to an earlier process at the same address, is told `reset` and gets what the log still
holds. Prefix-aware placement is a heuristic; losing events costs a preference, never a request.
"""

from __future__ import annotations

import threading
from typing import Optional

from inference.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from rollout.wire.kinds import MAX_KV_EVENTS
from rollout.wire.kv_events import KvEvent, KvEventBatch, KvOp

# the engine's KV events as the wire spells them (other events are not logged)
_OPS = {BlockStored: KvOp.STORED, BlockRemoved: KvOp.REMOVED, AllBlocksCleared: KvOp.CLEARED}


class KvEventLog:
    """Numbered events, oldest first; thread-safe (one writer, the engine loop; readers anywhere).

    Invariant: the log holds events `first ... next - 1` (at least the last `capacity` of them,
    fewer than twice that); event numbers never repeat within one log.
    """

    def __init__(self, block_size: int, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError(f"KvEventLog.capacity must be >= 1, got {capacity!r}")
        self.block_size = block_size
        self.capacity = capacity
        self._events: list[KvEvent] = []  # events first ... next - 1
        self._first = 0
        self._lock = threading.Lock()

    def __call__(self, event: KVEvent) -> None:
        """The engine's listener (on its loop thread): keep `event` as wire data."""
        op = _OPS.get(type(event))
        if op is None:
            return
        if op is KvOp.CLEARED:
            wire = KvEvent(KvOp.CLEARED)
        elif op is KvOp.STORED:
            wire = KvEvent(op, list(event.block_hashes), event.salt, event.version, event.computed_by)
        else:
            wire = KvEvent(op, list(event.block_hashes))
        with self._lock:
            self._events.append(wire)
            if len(self._events) >= 2 * self.capacity:  # NOTE: trimmed in halves: appends stay O(1) amortised
                drop = len(self._events) - self.capacity
                del self._events[:drop]
                self._first += drop

    @property
    def next(self) -> int:
        return self._first + len(self._events)

    def read(self, since: int, max_events: int = 4096, max_hashes: Optional[int] = None) -> KvEventBatch:
        """Events from `since` on: at most `max_events`, and at most `max_hashes` hashes in all
        (so the reply fits a frame; at least one event whatever its size)."""
        max_events = min(max_events, MAX_KV_EVENTS)
        with self._lock:
            first, last = self._first, self.next
            reset = not first <= since <= last
            start = first if reset else since
            window = self._events[start - first : start - first + max_events]
        out: list[KvEvent] = []
        hashes = 0
        for event in window:
            hashes += len(event.hashes)
            if out and max_hashes is not None and hashes > max_hashes:
                break
            out.append(event)
        end = start + len(out)
        return KvEventBatch(block_size=self.block_size, start=start, next=end, reset=reset, more=end < last,
                            events=out)
