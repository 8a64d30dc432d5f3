"""CoreCalls: how a call from any thread reaches the engine core.

Without a background loop a call runs at once under the engine's lock, between steps. After
`start()` an `EngineLoop` steps the core on a thread of its own, and a call from another thread
becomes a command on the loop's one queue (FIFO, applied between steps). Three ways to call:
`run(fn)` waits for the result (bounded by `command_timeout`), `post(fn)` returns a `Future` at
once, `when(condition)` a `Future` resolved once the condition holds after a round. A call made
on the loop thread itself (a command calling another engine method) runs directly.

Without a loop, nothing steps the core but a thread that waits: a `when` condition is checked
each time one does (`wait_until`, `settle`, `step_for_waiter`), so a future posted without a
loop (a WAIT pause's drain) resolves once its caller waits on it with `settle`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Optional

from inference.core.engine_core import EngineCore
from inference.core.loop import EngineLoop
from inference.errors import EngineStateError


class CoreCalls:
    """The lock and the optional loop in front of `core`; `on_step_error` runs on the loop when a
    step raises (the engine fails the streams in flight)."""

    def __init__(self, core: EngineCore, on_step_error: Callable[[BaseException], None], *,
                 command_timeout: float = 300.0) -> None:
        self.core, self.command_timeout = core, command_timeout
        self.lock = threading.RLock()
        self.loop: Optional[EngineLoop] = None
        self._on_step_error = on_step_error
        self._conditions: list[tuple[Callable[[], bool], Future]] = []  # `when`s without a loop, under the lock

    def _remote_loop(self) -> Optional[EngineLoop]:
        """The loop, when the caller is not on it (None: run the call here, under the lock)."""
        loop = self.loop
        return loop if loop is not None and not loop.is_loop_thread() else None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = self._remote_loop()
        if loop is not None:
            future = loop.submit(lambda: fn(*args, **kwargs))
            if future is not None:
                return future.result(self.command_timeout)
        with self.lock:
            return fn(*args, **kwargs)

    def post(self, fn: Callable[[], Any]) -> Future:
        loop = self._remote_loop()
        if loop is not None:
            future = loop.submit(fn)
            if future is not None:
                return future
        future = Future()
        try:
            with self.lock:
                future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 (handed to the caller through the future)
            future.set_exception(exc)
        return future

    def when(self, condition: Callable[[], bool]) -> Future:
        loop = self.loop
        future = loop.wait_for(condition) if loop is not None else None
        if future is not None:
            return future
        future = Future()
        with self.lock:
            self._conditions.append((condition, future))
            self._check_conditions()
        return future

    def _check_conditions(self) -> None:
        """Resolve the `when`s without a loop whose condition holds now (under the lock)."""
        waiting, self._conditions = self._conditions, []
        for condition, future in waiting:
            try:
                holds = condition()
            except BaseException as exc:  # noqa: BLE001 (handed to the caller through the future)
                future.set_exception(exc)
                continue
            if holds:
                future.set_result(None)
            else:
                self._conditions.append((condition, future))

    def settle(self, future: Future, timeout: Optional[float]) -> Any:
        """`future`'s result (its error raised), waiting at most `timeout` seconds (None: unbounded).
        Without a loop, the caller steps the core meanwhile while a `when` waits (a WAIT pause's
        drain); a call on the receiver's worker resolves by itself."""
        if self._remote_loop() is not None:
            return future.result(timeout)
        self.wait_until(future.done, timeout, step=lambda: bool(self._conditions))
        return future.result()

    def wait_until(self, condition: Callable[[], bool], timeout: Optional[float],
                   step: Callable[[], bool] = lambda: True) -> None:
        """Return once `condition()` holds; without a loop, step the core meanwhile (while `step()`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            loop = self._remote_loop()
            if loop is not None:
                future = loop.wait_for(condition)
                if future is not None:
                    future.result(timeout if timeout is not None else self.command_timeout)
                    return
            with self.lock:
                self._check_conditions()
                if condition():
                    return
                if self.loop is None and step() and self.core.can_step():
                    self.core.step()
                    continue
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"condition not reached within {timeout} s")
            time.sleep(0.002)

    def step_for_waiter(self) -> None:
        """Without a loop, a thread waiting on a stream makes progress itself: one step, or a
        short sleep when nothing can run (another thread may continue or resume the engine)."""
        with self.lock:
            if self.loop is None and self.core.can_step():
                self.core.step()
                self._check_conditions()
                return
        time.sleep(0.002)

    # ---- the background loop -----------------------------------------------------------------

    def start(self, idle_wait: float) -> None:
        with self.lock:
            if self.loop is not None:
                raise EngineStateError("the background loop is already running")
            self.loop = EngineLoop(self.lock, self.core.step, self.core.can_step, self._on_step_error,
                                   idle_wait=idle_wait)
            waiting, self._conditions = self._conditions, []
        for condition, future in waiting:  # NOTE: the loop checks them from now on
            self._chain(self.when(condition), future)

    def stop(self, timeout: float) -> None:
        """End the loop after the commands already queued. An expert-parallel rank first stops
        its group with it (every rank's loop then idles)."""
        loop = self.loop
        if loop is None:
            return
        ep = self.core.ep
        if ep is not None and not ep.stopped:
            ep.leave()
            done = loop.wait_for(lambda: ep.stopped)
            if done is not None:
                done.result(timeout)
        loop.stop(timeout)
        self.loop = None

    @staticmethod
    def _chain(source: Future, target: Future) -> None:
        source.add_done_callback(lambda f: target.set_exception(f.exception()) if f.exception() is not None
                                 else target.set_result(None))

    def seconds_since_tick(self) -> Optional[float]:
        loop = self.loop
        return None if loop is None else loop.seconds_since_tick()
