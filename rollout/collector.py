"""The bookkeeping under every sample stream (`rollout.backend.SampleStream`): one definition.

A stream sends requests (one per prompt, or one per sample) and yields each finished sample once.
`SampleCollector` keeps what that takes, whatever carries the samples (the engine's callbacks in
process, an in-process client's event loop, a ZMQ connection): the samples each request still
owes, the ones taken (a repeat, e.g. a resubmitted request's, is dropped), the stream's deadline,
and, when the stream gives up (an error, its deadline), the requests to abort. Its one writer is
the stream's reader (the thread or task that iterates it).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import Optional


class SampleCollector:
    """Samples owed and taken for `request_ids` (`owed[i]` samples for request i, its group), within
    `timeout` seconds (None: no deadline). A request id is any hashable: the wire's strings, the
    engine's ints (in process, where each sample is a request of its own)."""

    __slots__ = ("request_ids", "remaining", "timeout", "deadline", "_left", "_taken")

    def __init__(self, request_ids: Sequence[Hashable], owed: Sequence[int], timeout: Optional[float]) -> None:
        if len(request_ids) != len(owed):
            raise ValueError(f"SampleCollector: {len(request_ids)} requests, {len(owed)} counts owed")
        self.request_ids = list(request_ids)
        self._left = dict(zip(self.request_ids, owed))
        self.remaining = sum(owed)
        self._taken: set[tuple[int, int]] = set()
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout

    @property
    def done(self) -> bool:
        """Every sample taken, or the stream gave up."""
        return self.remaining <= 0

    def taken(self, group: int, sample_index: int) -> bool:
        return (group, sample_index) in self._taken

    def take(self, group: int, sample_index: int) -> bool:
        """Count a finished sample of request `group`; False (nothing counted) if it was taken already."""
        key = (group, sample_index)
        if key in self._taken:
            return False
        self._taken.add(key)
        self.remaining -= 1
        self._left[self.request_ids[group]] -= 1
        return True

    def left(self, group: int) -> int:
        return self._left[self.request_ids[group]]

    def refuse(self, group: int) -> None:
        """Request `group` will send nothing more (its error was received)."""
        self._left[self.request_ids[group]] = 0

    def unfinished(self) -> list[Hashable]:
        """The requests still owing samples: what an abort targets."""
        return [rid for rid, left in self._left.items() if left > 0]

    def give_up(self) -> list[Hashable]:
        """Stop waiting: the stream is done from now on; the requests to abort."""
        self.remaining = 0
        return self.unfinished()

    def wait_s(self) -> Optional[float]:
        """How long a reader may wait for the next sample (None: no deadline)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def within(self, timeout: Optional[float]) -> None:
        """Bring the deadline in to `timeout` seconds from now, if that is sooner (`result(timeout)`)."""
        if timeout is None:
            return
        deadline = time.monotonic() + timeout
        self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)
        self.timeout = timeout if self.timeout is None else min(self.timeout, timeout)
