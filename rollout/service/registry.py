"""RequestRegistry: the server's exactly-once table of client-chosen Generate ids.

A client names each `Generate` with an id of its own choosing (unique within its session). The
server keeps one `Record` per id: while it runs, and for `retain_s` after its last sample was
sent, so a client that lost its connection and resubmits every unanswered request gets each one
answered without running it again:

* a new id is registered and run;
* an id already held, for the same request (equal message), moves to its newest sender: the
  samples already finished are sent again from their encoded frames, the rest follow as they
  finish (the client keeps the first copy of each sample index);
* an id already held for a different request is refused (`DUPLICATE`).

Pure bookkeeping on the server's socket thread (no locks, clock passed in). The engine-side
handle (`Record.stream`) is written by the engine call that submits it, on the engine's loop, before
any later call on the record (an Abort) runs there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from rollout.wire.messages import Generate


@dataclass(eq=False, slots=True)
class Record:
    """One Generate: who asked (latest sender), its samples' frames as they finished."""

    request_id: str
    request: Generate
    owner: bytes
    n: int
    frames: dict[int, bytes] = field(default_factory=dict)  # sample index -> encoded SampleOutput
    stream: Any = None  # the engine's RequestStream (a router's Route); written on the engine's loop
    finished_at: Optional[float] = None

    @property
    def admission_client(self) -> str:
        """Whom the request is for, as an engine's admission takes turns: its sender's connection,
        and within it the client that sender named (a router forwarding for its own clients).
        NOTE: a name only splits its own connection's turn; a direct client gains nothing by it
        that a second connection would not give it."""
        named = self.request.client
        return self.owner.hex() if not named else f"{self.owner.hex()}/{named}"

    @property
    def done(self) -> bool:
        return len(self.frames) == self.n


class RequestRegistry:
    """Records by request id, with an index of unfinished ones by owner (for lease expiry).

    Invariants: `_live[owner]` holds exactly the ids of unfinished records with that owner; a
    finished record is in `_retired` (in finishing order) until `purge` drops it.
    """

    def __init__(self, retain_s: float = 120.0, max_retained: int = 200_000) -> None:
        self.retain_s = retain_s
        self.max_retained = max_retained
        self._records: dict[str, Record] = {}
        self._live: dict[bytes, set[str]] = {}
        self._retired: deque[tuple[float, str]] = deque()

    def get(self, request_id: str) -> Optional[Record]:
        return self._records.get(request_id)

    def add(self, msg: Generate, owner: bytes) -> Record:
        if msg.request_id in self._records:
            raise KeyError(f"request id {msg.request_id!r} is already registered")
        record = Record(msg.request_id, msg, owner, msg.sampling.n)
        self._records[msg.request_id] = record
        self._live.setdefault(owner, set()).add(msg.request_id)
        return record

    def move(self, record: Record, owner: bytes) -> None:
        """The record's answers go to `owner` from now on (a resubmission after a reconnect)."""
        if owner == record.owner:
            return
        if not record.done:
            self._unlink(record)
            self._live.setdefault(owner, set()).add(record.request_id)
        record.owner = owner

    def finish_sample(self, record: Record, sample_index: int, frame: bytes, now: float) -> bool:
        """Keep a finished sample's frame; True if it is new (False: already had it)."""
        if sample_index in record.frames:
            return False
        record.frames[sample_index] = frame
        if record.done:
            record.finished_at = now
            self._unlink(record)
            self._retired.append((now, record.request_id))
        return True

    def drop(self, record: Record) -> None:
        """Forget a record at once (the engine refused it: a resubmission may run it again)."""
        if self._records.get(record.request_id) is record:
            del self._records[record.request_id]
            if not record.done:
                self._unlink(record)

    def live_of(self, owner: bytes) -> list[Record]:
        """The unfinished records `owner` is waiting for."""
        return [self._records[rid] for rid in self._live.get(owner, ())]

    @property
    def num_live(self) -> int:
        return sum(len(ids) for ids in self._live.values())

    def purge(self, now: float) -> int:
        """Drop finished records older than `retain_s` (or beyond `max_retained`); how many."""
        dropped = 0
        while self._retired and (self._retired[0][0] <= now - self.retain_s
                                 or len(self._retired) > self.max_retained):
            _, rid = self._retired.popleft()
            record = self._records.get(rid)
            if record is not None and record.done:
                del self._records[rid]
                dropped += 1
        return dropped

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._records

    def _unlink(self, record: Record) -> None:
        ids = self._live.get(record.owner)
        if ids is not None:
            ids.discard(record.request_id)
            if not ids:
                del self._live[record.owner]
