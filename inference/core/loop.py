"""EngineLoop: a background thread that steps the engine core and applies commands between steps.

While the loop runs, every call from another thread becomes a command on its queue, returning
through a `Future`; the loop takes the engine's lock, applies all queued commands, steps once if
there is work, resolves waiters whose condition now holds, and goes round again. It ticks even
when idle (every `idle_wait` seconds), so `seconds_since_tick()` tells a live loop from a wedged
one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Optional

from inference.core.omp_pool import release_caller_pool

logger = logging.getLogger(__name__)

Command = Callable[[], Any]


class EngineLoop:
    """Steps `step()` while `has_work()`, under `lock`, applying submitted commands in between.

    Invariants: commands run in submission order, on the loop thread, never during a step; a
    command accepted by `submit` is always run (also when the loop is stopping), so its future
    always completes; after `stop()` returns, `submit` refuses (returns None).
    """

    def __init__(
        self,
        lock: threading.RLock,
        step: Callable[[], None],
        has_work: Callable[[], bool],
        on_step_error: Callable[[BaseException], None],
        *,
        idle_wait: float = 0.005,
        name: str = "engine-loop",
    ) -> None:
        self._lock = lock
        self._step = step
        self._has_work = has_work
        self._on_step_error = on_step_error
        self._idle_wait = idle_wait
        self._cv = threading.Condition()  # guards _commands, _waiters, _accepting
        self._commands: deque[tuple[Command, Future]] = deque()
        self._waiters: list[tuple[Callable[[], bool], Future]] = []
        self._accepting = True
        self._last_tick = time.monotonic()
        self.hold: Optional[threading.Event] = None  # test hook: while set-and-cleared, the loop blocks
        # NOTE: the steps move to the loop thread: the caller's OpenMP workers would throttle its own
        release_caller_pool()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- other threads -----------------------------------------------------------------------

    def is_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def seconds_since_tick(self) -> float:
        """Time since the loop last went round (idle rounds count)."""
        return time.monotonic() - self._last_tick

    def submit(self, command: Command) -> Optional[Future]:
        """Queue `command` for the loop; None once the loop is stopping (run it yourself)."""
        with self._cv:
            if not self._accepting:
                return None
            future: Future = Future()
            self._commands.append((command, future))
            self._cv.notify()
            return future

    def wait_for(self, condition: Callable[[], bool]) -> Optional[Future]:
        """A future resolved (on the loop thread) once `condition()` holds after some round."""
        with self._cv:
            if not self._accepting:
                return None
            future: Future = Future()
            self._waiters.append((condition, future))
            self._cv.notify()
            return future

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the queued commands, fail pending waiters, and end the thread."""
        with self._cv:
            self._accepting = False
            self._cv.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the engine loop did not stop within {timeout} s (a step is stuck?)")

    # ---- the loop thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._commands and self._accepting and not self._has_work():
                    self._cv.wait(self._idle_wait)
                commands = list(self._commands)
                self._commands.clear()
                stopping = not self._accepting
            hold = self.hold
            if hold is not None:
                hold.wait()
            with self._lock:
                self._last_tick = time.monotonic()
                for command, future in commands:
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(command())
                        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                            future.set_exception(exc)
                if stopping:
                    break
                if self._has_work():
                    try:
                        self._step()
                    except Exception as exc:
                        logger.exception("engine step failed; the requests in flight are aborted")
                        self._on_step_error(exc)
                self._resolve_waiters()
        self._fail_waiters()

    def _resolve_waiters(self) -> None:
        if not self._waiters:
            return
        with self._cv:
            waiters, self._waiters = self._waiters, []
        keep = []
        for condition, future in waiters:
            try:
                if condition():
                    future.set_result(None)
                else:
                    keep.append((condition, future))
            except Exception as exc:
                future.set_exception(exc)
        with self._cv:
            self._waiters.extend(keep)

    def _fail_waiters(self) -> None:
        with self._cv:
            waiters, self._waiters = self._waiters, []
        for _, future in waiters:
            if not future.done():
                future.set_exception(RuntimeError("the engine loop stopped before the condition held"))
