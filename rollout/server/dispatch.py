"""ServerCalls: a server's request handlers: every kind its `EngineService` answers
(`rollout.service.engine_service`), and the few answered from what only the server holds (its
requests to abort, its traffic in `Stats`, the KV event log, heartbeats).

Nothing here waits: each call returns a `Future` whose done-callback puts a `CallReply` into the
endpoint's mailbox, and the socket thread sends the answer when it drains it. So a WAIT pause
(answered once the engine drained) and a weight update (answered at its commit) never hold up the
calls behind them. Order is the loop's: a control call posted after a Generate runs after it
(queued Generates are handed to the engine first, in one `submit_each`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

from inference import PendingAdmission
from rollout.service.engine_service import SERVICE_KINDS
from rollout.wire.codec import ProtocolError
from rollout.wire.kinds import ErrorCode
from rollout.wire.messages import Abort, Heartbeat, KvEvents, RequestMessage, Result, Stats, kind_of


@dataclass(slots=True)
class CallReply:
    """A posted call finished: `render(value)` is what the reply's `Result` carries beyond its
    version (`stats`, `sleeping`, ...; empty: nothing)."""

    peer: Optional[bytes]
    msg: RequestMessage
    future: Future
    render: Callable[[Any], dict]


class ServerCalls:
    """The handlers of `RolloutServer` (a table by message class, `table()`); `server` is the
    owner: its engine, receiver, KV log, endpoint and the flush of queued Generates."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.engine = server.engine

    def table(self) -> dict[type, Callable[[bytes, Any, float], None]]:
        """The handler of each message class (every kind but Generate)."""
        served = dict.fromkeys(SERVICE_KINDS, self.service_call)
        return {**served, Abort: self.abort, Stats: self.stats, Heartbeat: self.heartbeat,
                KvEvents: self.kv_events}

    # ---- answered without the engine -----------------------------------------------------------

    def _result(self, msg: RequestMessage, **fields: Any) -> Result:
        return Result(request_id=msg.request_id, request_kind=kind_of(type(msg)),
                      policy_version=self.engine.policy_version, **fields)

    def heartbeat(self, peer: bytes, msg: Any, now: float) -> None:
        self.server.endpoint.send(peer, self._result(msg))

    def kv_events(self, peer: bytes, msg: KvEvents, now: float) -> None:
        # NOTE: a hash takes at most 9 bytes of msgpack, an event's framing 3 more
        limit = (self.server.endpoint.config.max_frame_bytes - 512) // 12
        batch = self.server.kv_log.read(msg.since, msg.max_events, max_hashes=limit)
        self.server.endpoint.send(peer, self._result(msg, kv_events=batch))

    # ---- posted to the engine's loop -----------------------------------------------------------

    def _post(self, peer: Optional[bytes], msg: RequestMessage, call: Callable[[], Future],
              render: Callable[[Any], dict] = lambda fields: fields) -> None:
        """`call()` (the engine service's, or a post of the server's own) once the Generates read
        before `msg` were handed to the engine, so it runs after them."""
        self.server.flush_generates()
        future, mailbox = call(), self.server.endpoint.mailbox
        future.add_done_callback(lambda f: mailbox.put(CallReply(peer, msg, f, render)))

    def service_call(self, peer: bytes, msg: RequestMessage, now: float) -> None:
        """A kind the engine service answers, posted after the Generates read before it."""
        self._post(peer, msg, lambda: self.server.service.handle(msg))

    def abort(self, peer: Optional[bytes], msg: Abort, now: float, records: Optional[list] = None) -> None:
        if records is None:
            records = [r for r in map(self.server.endpoint.registry.get, msg.targets) if r is not None]
            if not records:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no request with id {msg.targets[0]!r}"
                                    + (f" (nor {len(msg.targets) - 1} more)" if len(msg.targets) > 1 else ""))

        def call() -> dict:  # NOTE: on the loop, after the Generates posted before it set their streams
            for r in records:
                if isinstance(r.stream, PendingAdmission):  # NOTE: its grammar still builds: aborted once admitted
                    r.stream.cancel()
            ids = [rid for r in records if r.stream is not None for rid in r.stream.request_ids]
            return {"aborted": self.engine.abort_many(ids)}

        self._post(peer, msg, lambda: self.engine.post(call), lambda value: {"stats": value})

    def stats(self, peer: bytes, msg: Stats, now: float) -> None:
        self._post(peer, msg, self.server.service.figures,
                   lambda figures: {"stats": self.server.stats_snapshot(figures)})
