"""Connection limits of the HTTP front: what a client may hold of it before it sent a request.

uvicorn bounds a connection's idle time between requests (`timeout_keep_alive`), nothing else: a
client that trickles its headers (a byte every few seconds) or never finishes its body keeps its
socket, and its file descriptor, for as long as it likes; enough of them exhaust the process's
descriptors, which the engine's ZMQ server shares. `GuardedProtocol` (uvicorn's httptools
protocol, subclassed) adds what nginx calls `client_header_timeout` and `client_body_timeout`, a
bound on the bytes of a request head, and a bound on open connections:

* a request head (request line and headers) must arrive within `header_timeout_s` of the
  connection opening or of the request's first byte, else 408 and the connection is closed;
* a body must arrive within `body_timeout_s` of its head, else the connection is closed (the
  route sees the client gone);
* a head over `max_header_bytes` is refused with 431;
* past `max_connections` open connections a new one is answered 503 and closed at once, so the
  descriptors HTTP holds stay bounded whatever clients do.

A refusal is closed as nginx's lingering close does it: the answer is written, the sending side
shut, and what the client still sends read and dropped for up to `LINGER_S`; closing a socket
with unread bytes in it makes the kernel answer with a reset, which a client reads as "connection
reset" instead of the status it was sent.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Optional

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 5  # uvicorn's default idle bound between requests
LINGER_S = 1.0  # how long a refused connection's late bytes are read and dropped before it closes


def default_max_connections() -> int:
    """1024, or half the process's descriptor limit when that is lower: the rest stay for the
    engine (its ZMQ sockets, model files) whatever HTTP clients do."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(8, min(1024, soft // 2))


@dataclass(slots=True)
class ConnectionLimits:
    """What one HTTP connection may take (see module docstring); `max_body_bytes` is enforced per
    request by `rollout.http.core.guards.RequestGuard` (a 413 in the route's error format)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 32 * 2**20
    max_connections: int = field(default_factory=default_max_connections)

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "max_header_bytes", "max_body_bytes", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ConnectionLimits.{name} must be > 0, got {getattr(self, name)}")


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of `LIMITS` (set by `protocol_class`).

    Invariant: while a request head is incomplete `_deadline` is the header timer, while its body
    is incomplete the body timer, and None while the app answers or the connection is idle
    between requests (uvicorn's keep-alive timer covers that)."""

    LIMITS: ConnectionLimits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: Optional[asyncio.TimerHandle] = None
        self._in_head = True
        self._head_bytes = 0
        self._lingering = False  # refused: what arrives now is dropped unread

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.LIMITS.max_connections:
            logger.warning("HTTP: %d connections open, the limit is %d: refusing %s", len(self.connections) - 1,
                           self.LIMITS.max_connections, self.client)
            self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, "Too many open connections; retry later.", retry_after=1)
            return
        self._arm(self.LIMITS.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        super().data_received(data)
        # NOTE: counted after parsing, so a chunk that completes the head (and carries body bytes) is not
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.LIMITS.max_header_bytes:
                self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                             f"The request head exceeds {self.LIMITS.max_header_bytes} bytes.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0
        if self._deadline is None:  # a keep-alive connection's next request: its head has the same bound
            self._arm(self.LIMITS.header_timeout_s, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.LIMITS.body_timeout_s, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    # ---- timers and refusals ---------------------------------------------------------------------

    def _arm(self, seconds: float, callback: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_timed_out(self) -> None:
        self._deadline = None
        logger.info("HTTP: %s sent no complete request head within %.1f s: closed", self.client,
                    self.LIMITS.header_timeout_s)
        self._refuse(HTTPStatus.REQUEST_TIMEOUT, "The request head did not arrive in time.")

    def _body_timed_out(self) -> None:
        self._deadline = None
        logger.info("HTTP: %s sent no complete body within %.1f s: closed", self.client, self.LIMITS.body_timeout_s)
        self.transport.close()  # NOTE: its route is running: it sees the client gone (and aborts its work)

    def _refuse(self, status: HTTPStatus, message: str, retry_after: Optional[int] = None) -> None:
        """Answer `status` in plain text and close, unless a response is under way (then close only)."""
        self._disarm()
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:
            body = message.encode()
            head = [f"HTTP/1.1 {status.value} {status.phrase}", "content-type: text/plain; charset=utf-8",
                    f"content-length: {len(body)}", "connection: close"]
            if retry_after is not None:
                head.append(f"retry-after: {retry_after}")
            self.transport.write("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self._lingering = True  # NOTE: a lingering close (module docstring): the answer is read, not reset
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


def protocol_class(limits: ConnectionLimits) -> type[GuardedProtocol]:
    """A `GuardedProtocol` bound to `limits`, for uvicorn's `Config(http=...)` (which builds one per
    connection from its config alone)."""
    return type("GuardedProtocol", (GuardedProtocol,), {"LIMITS": limits})
