"""The weight routes' calls: `rollout.weight_calls.WeightSyncCalls` (SGLang's names and fields
mapped onto the wire, owned by the weight-sync side) over the HTTP front's own connection.

Those calls block until the engine answers, so the routes run them on a worker thread; each
waits on a plain future that the connection's I/O thread settles, never on the event loop.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Optional

from rollout import messages as wire
from rollout.connection import Connection, ControlPending
from rollout.weight_calls import WeightSyncCalls


class WeightCalls(WeightSyncCalls):
    """SGLang-named weight calls over `connection` (shared with the front's async client)."""

    def __init__(self, connection: Connection, timeout: float) -> None:
        self.connection, self.timeout = connection, timeout

    def _call(self, msg: Any, timeout: Optional[float]) -> wire.Result:
        timeout = self.timeout if timeout is None else timeout
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.connection.send(msg, ControlPending(future.set_result, future.set_exception))
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            self.connection.forget([msg.request_id])
            raise TimeoutError(f"{type(msg).__name__} got no reply within {timeout} s") from None
