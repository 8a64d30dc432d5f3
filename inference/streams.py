"""RequestStream: the one channel through which a submitted prompt's outputs reach its caller.

The engine delivers into a stream (under its lock, on whichever thread steps); the caller reads
from it on its own thread. Without a background loop, a caller waiting on a stream steps the
engine itself, so streams work the same whether or not `engine.start()` was called.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Optional, Protocol, Union

from inference.request import RequestOutput, TokenEvent

logger = logging.getLogger(__name__)

StreamItem = Union[TokenEvent, RequestOutput]
Callback = Callable[[StreamItem], None]


class StreamOwner(Protocol):
    """What a stream needs of its engine (the engine imports this module, not the reverse)."""

    @property
    def loop_running(self) -> bool: ...

    def step_for_waiter(self) -> None: ...

    def abort_many(self, request_ids: list[int]) -> int: ...


class EngineStepError(RuntimeError):
    """A step failed while this stream's requests were in flight; they were aborted."""


class RequestStream:
    """The n samples of one submitted prompt, delivered as they happen.

    Iterating yields `TokenEvent`s (when the stream asked for tokens) and each sample's final
    `RequestOutput`, in the order they happened, and ends once every sample has finished.
    `result()` waits for all samples and returns their outputs by sample index. With a
    `callback`, every item is passed to it instead (on the engine's stepping thread, under its
    lock: keep it short and never call the engine from it); `result()` still works.

    Invariant: each of `request_ids` gets exactly one final output, delivered exactly once.
    """

    def __init__(self, engine: StreamOwner, request_ids: list[int],
                 callback: Optional[Callback] = None) -> None:
        self.request_ids = list(request_ids)
        self._engine = engine
        self._callback = callback
        self._cond = threading.Condition()
        self._items: deque[StreamItem] = deque()
        self._finals: dict[int, RequestOutput] = {}
        self._error: Optional[BaseException] = None

    # ---- engine side (called under the engine's lock) ----------------------------------------

    def deliver(self, item: StreamItem) -> None:
        with self._cond:
            if isinstance(item, RequestOutput):
                self._finals[item.request_id] = item
            if self._callback is None:
                self._items.append(item)
            self._cond.notify_all()
        if self._callback is not None:
            try:
                self._callback(item)
            except Exception:  # NOTE: a caller's callback must never stop the engine's loop
                logger.exception("a stream callback raised; the engine goes on")

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    # ---- caller side -------------------------------------------------------------------------

    def done(self) -> bool:
        """Every sample has finished (its final output is here)."""
        return len(self._finals) == len(self.request_ids)

    def result(self, timeout: Optional[float] = None) -> list[RequestOutput]:
        """Wait for every sample; their outputs by sample index. Raises `TimeoutError` after
        `timeout` seconds (the requests go on), `EngineStepError` if a step failed under them."""
        self._wait(self.done, timeout)
        if self._error is not None:
            raise EngineStepError(f"a step failed while requests {self.request_ids} ran: {self._error}") \
                from self._error
        return [self._finals[rid] for rid in self.request_ids]

    def __iter__(self) -> Iterator[StreamItem]:
        return self.items()

    def items(self, timeout: Optional[float] = None) -> Iterator[StreamItem]:
        """Yield items as they arrive; `timeout` bounds the wait for each next item."""
        if self._callback is not None:
            raise RuntimeError("this stream hands its items to a callback; use result()")
        while True:
            self._wait(lambda: bool(self._items) or self.done(), timeout)
            with self._cond:  # NOTE: take the batch under the lock, yield outside it
                batch = list(self._items)
                self._items.clear()
                finished = self.done()
            yield from batch
            if finished:
                if self._error is not None:
                    raise EngineStepError(f"a step failed under requests {self.request_ids}") from self._error
                return

    def abort(self) -> None:
        """Abort the samples not finished yet (their partial outputs still arrive here)."""
        pending = [rid for rid in self.request_ids if rid not in self._finals]
        if pending:
            self._engine.abort_many(pending)

    def _wait(self, ready: Callable[[], bool], timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if ready() or self._error is not None:
                    return
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"requests {self.request_ids} not done after {timeout} s")
                if self._engine.loop_running:
                    # NOTE: wake up now and then: the loop may stop, and then this thread steps
                    self._cond.wait(0.1 if remaining is None else min(remaining, 0.1))
                    continue
            self._engine.step_for_waiter()


class PendingAdmission:
    """A prompt that `submit_each(..., defer_compiles=True)` took while its grammar compiles, in
    place of its `RequestStream`: admitted (checked and queued, as `submit` would) on the loop once
    the grammar is built, its items then passed to the callback it was given; a refusal found then
    (the grammar's, or any other check's) is passed to that callback as the exception it is.

    `request_ids` is empty until it is admitted. `cancel()` (on the loop, as an abort is) makes
    the admission abort its requests at once: a caller that aborted it before its grammar was
    built gets the usual aborted outputs."""

    def __init__(self) -> None:
        self.stream: Optional[RequestStream] = None
        self.cancelled = False

    @property
    def request_ids(self) -> list[int]:
        return [] if self.stream is None else self.stream.request_ids

    def cancel(self) -> None:
        self.cancelled = True
