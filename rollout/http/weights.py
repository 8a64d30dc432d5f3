"""The weight routes' calls: `rollout.client.weights.WeightSyncCalls` (SGLang's names and fields
mapped onto the wire, owned by the weight-sync side) over the HTTP front's own connection.

Those calls block until the engine answers, so the routes run them on a worker thread; each
waits on a plain future that the connection's I/O thread settles, never on the event loop.
"""

from __future__ import annotations

from typing import Any, Optional

from rollout.client.connection import Connection
from rollout.client.streams import call_blocking
from rollout.client.weights import WeightSyncCalls
from rollout.wire import messages as wire


class WeightCalls(WeightSyncCalls):
    """SGLang-named weight calls over `connection` (shared with the front's async client)."""

    def __init__(self, connection: Connection, timeout: float) -> None:
        self.connection, self.timeout = connection, timeout

    def _call(self, msg: Any, timeout: Optional[float]) -> wire.Result:
        return call_blocking(self.connection, msg, self.timeout if timeout is None else timeout)
