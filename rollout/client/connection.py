"""Connection: a client's DEALER socket and the I/O thread that alone touches it.

Callers on any thread hand frames to the I/O thread through a mailbox; the thread sends them,
routes each reply by its request id to the `Pending` that waits for it, sends heartbeats (the
client's lease on the server) and reconnects:

* `reconnect()` (or silence from the server for `reconnect_after_s` while anything is owed)
  replaces the socket with a new one, so the server sees a new peer, and resubmits every
  unanswered Generate with its same id and bytes: the server runs none twice and sends each
  sample again to the new peer if it had finished (the pending keeps the first copy);
* control requests that are safe to repeat (Abort, Stats, Health) are resent as well; any other
  in flight fails with `ConnectionResetError`, since the server may or may not have applied it.

A server that refuses the client's credentials (a wrong token, an unknown CURVE key, none given)
fails every request at once with `PermissionError`, instead of letting it time out: the socket's
monitor reports the failed handshake.
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, Optional, Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from rollout.wire.codec import DEFAULT_MAX_FRAME_BYTES, ProtocolError, decode_reply, encode
from rollout.wire.convert import error_from_reply
from rollout.wire.kinds import MAX_LEASE_SECONDS, Kind
from rollout.wire.mailbox import Mailbox
from rollout.wire.messages import Abort, ErrorReply, Generate, Health, Heartbeat, Stats
from rollout.wire.security import ClientSecurity, secure_client_socket

logger = logging.getLogger(__name__)

_RESENDABLE = (Generate, Abort, Stats, Health)
# NOTE: a service cuts the lease a client asks for to its max_lease_s (60 s by default): a client
# that asked for more still beats often enough to keep the lease it is actually granted
MAX_HEARTBEAT_EVERY_S = 10.0
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL \
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class Pending(Protocol):
    """What waits for the replies to one request (called on the I/O thread only)."""

    def on_reply(self, msg: Any) -> bool:
        """Take one reply; True once the request is fully answered."""

    def on_failure(self, error: BaseException) -> None:
        """The request will get no (further) reply: the client closed, or the connection reset."""


class Connection:
    """One client's link to a server (see module docstring). Thread-safe; the socket is the I/O
    thread's alone. `session` prefixes every request id, so ids are unique across clients."""

    def __init__(self, address: str, *, security: Optional[ClientSecurity] = None, lease_s: float = 10.0,
                 heartbeat_s: Optional[float] = None, reconnect_after_s: Optional[float] = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if not 0 < lease_s <= MAX_LEASE_SECONDS:
            raise ValueError(f"lease_s must be in (0, {MAX_LEASE_SECONDS:g}], got {lease_s!r}")
        self.address = address
        self.security = security
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else min(lease_s / 4, MAX_HEARTBEAT_EVERY_S)
        self.reconnect_after_s = reconnect_after_s if reconnect_after_s is not None else max(2.0, lease_s)
        self.max_frame_bytes = max_frame_bytes
        self.session = secrets.token_hex(6)
        self._ids = itertools.count()
        self.reconnects = 0
        self._ctx = zmq.Context()
        self._mailbox = Mailbox()
        self._pending: dict[str, tuple[Any, bytes, Pending]] = {}  # I/O thread only: id -> (msg, frame, pending)
        self._backlog: collections.deque[bytes] = collections.deque()  # frames the socket did not take yet
        self._closing = False
        self.auth_error: Optional[PermissionError] = None
        self._monitor: Optional[zmq.Socket] = None
        self._socket = self._new_socket()  # NOTE: created here, used only by the I/O thread from now on
        self._thread = threading.Thread(target=self._run, name=f"rollout-client-{self.session}", daemon=True)
        self._thread.start()

    def next_id(self, prefix: str = "r") -> str:
        return f"{self.session}-{prefix}{next(self._ids)}"

    # ---- any thread ----------------------------------------------------------------------------

    def send(self, msg: Any, pending: Optional[Pending], frame: Optional[bytes] = None) -> None:
        """Encode `msg` here (a refusal raises in the caller; or give its `frame`) and queue it;
        `pending` gets its replies."""
        if frame is None:
            frame = encode(msg, max_frame_bytes=self.max_frame_bytes)
        if self._closing:
            raise ConnectionError("the client is closed")
        if self.auth_error is not None:
            raise self.auth_error
        self._mailbox.put(("send", msg, frame, pending))

    def forget(self, request_ids: list[str]) -> None:
        """Stop routing replies for these ids (a caller gave up on them)."""
        self._mailbox.put(("forget", request_ids))

    def reconnect(self) -> None:
        self._mailbox.put(("reconnect",))

    def close(self, timeout: float = 5.0) -> None:
        if self._closing:
            return
        self._closing = True
        self._mailbox.put(("close",))
        self._thread.join(timeout)
        self._mailbox.close()
        if self._thread.is_alive():  # NOTE: never block the caller on a stuck thread; let the sockets go
            logger.error("the client's I/O thread did not stop within %.1f s", timeout)
            return
        self._ctx.term()

    # ---- the I/O thread ------------------------------------------------------------------------

    def _new_socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.sndhwm = 0  # NOTE: queue requests while (re)connecting rather than refuse them
        sock.rcvhwm = 0
        sock.maxmsgsize = 2 * self.max_frame_bytes
        if "[" in self.address:
            sock.ipv6 = True
        secure_client_socket(sock, self.security)
        self._monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED)
        sock.connect(self.address)
        return sock

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._mailbox.fileno(), zmq.POLLIN)
        now = time.monotonic()
        self._last_heard = self._last_connect = now
        self._next_heartbeat = now  # the first heartbeat announces the lease at once
        try:
            while True:
                now = time.monotonic()
                wait = max(0.0, min(self._next_heartbeat - now, 0.1))
                events = dict(poller.poll(int(wait * 1000) + 1))
                if self._socket in events:
                    self._read()
                if self._monitor in events:
                    self._handshake_failed()
                for command in self._mailbox.drain():
                    if command[0] == "close":
                        return
                    if command[0] == "reconnect":
                        poller = self._replace_socket(poller)
                    else:
                        self._command(command)
                self._flush()
                now = time.monotonic()
                if now >= self._next_heartbeat:
                    self._heartbeat(now)
                if self._pending and now - self._last_heard > self.reconnect_after_s \
                        and now - self._last_connect > self.reconnect_after_s:
                    logger.warning("no word from %s for %.1f s: reconnecting", self.address, now - self._last_heard)
                    poller = self._replace_socket(poller)
        finally:
            self._close_socket()
            for _, _, pending in self._pending.values():
                if pending is not None:
                    pending.on_failure(ConnectionError("the client was closed"))
            self._pending.clear()

    def _command(self, command: tuple) -> None:
        if command[0] == "send":
            _, msg, frame, pending = command
            if self.auth_error is not None:  # queued before the handshake failed, taken after
                if pending is not None:
                    pending.on_failure(self.auth_error)
                return
            if pending is not None:
                self._pending[msg.request_id] = (msg, frame, pending)
            self._send(frame)
        elif command[0] == "forget":
            for rid in command[1]:
                self._pending.pop(rid, None)

    def _close_socket(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)

    def _handshake_failed(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            what = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused our credentials",
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "speaks another security mechanism (token / CURVE / none)"}
            self.auth_error = PermissionError(f"{self.address} {what.get(event['event'], 'failed the handshake')}")
        pending, self._pending = self._pending, {}
        for _, _, p in pending.values():
            if p is not None:
                p.on_failure(self.auth_error)

    def _send(self, frame: bytes) -> None:
        """Never blocks (a DEALER with no peer would): what the socket does not take waits, in order."""
        if not self._backlog:
            try:
                self._socket.send(frame, zmq.NOBLOCK, copy=len(frame) < 65536)
                return
            except zmq.Again:
                pass
        self._backlog.append(frame)

    def _flush(self) -> None:
        while self._backlog:
            try:
                self._socket.send(self._backlog[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._backlog.popleft()

    def _heartbeat(self, now: float) -> None:
        self._next_heartbeat = now + self.heartbeat_s
        if not self._backlog:  # NOTE: heartbeats do not pile up behind a connection that takes nothing
            self._send(encode(Heartbeat(request_id=self.next_id("hb"), lease_s=self.lease_s)))

    def _read(self) -> None:
        while True:
            try:
                frame = self._socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            try:
                msg = decode_reply(frame.buffer, self.max_frame_bytes)
            except ProtocolError as err:
                logger.error("unreadable reply from %s: %s", self.address, err)
                continue
            entry = self._pending.get(msg.request_id) if msg.request_id is not None else None
            if entry is None:
                if isinstance(msg, ErrorReply):
                    logger.error("error reply for no pending request: %s %s", msg.code.name, msg.message)
                continue  # a heartbeat's Result, or a late reply to a request given up
            if entry[2].on_reply(msg):
                del self._pending[msg.request_id]

    def _replace_socket(self, poller: zmq.Poller) -> zmq.Poller:
        """A fresh socket (a new peer for the server); resubmit what is owed, fail what cannot be."""
        self.reconnects += 1
        self.auth_error = None
        poller.unregister(self._socket)
        poller.unregister(self._monitor)
        self._close_socket()
        self._socket = self._new_socket()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        now = time.monotonic()
        self._last_connect = self._last_heard = now
        self._backlog.clear()  # NOTE: what is owed is resent below; the rest was fire-and-forget
        self._heartbeat(now)
        for rid, (msg, frame, pending) in list(self._pending.items()):
            if isinstance(msg, _RESENDABLE):
                self._send(frame)
            else:
                del self._pending[rid]
                pending.on_failure(ConnectionResetError(
                    f"{Kind(msg.__struct_config__.tag).name} {rid!r} was in flight when the connection was "
                    "replaced: the server may or may not have applied it"))
        return poller


class ControlPending:
    """The one reply to a control request, as a `concurrent.futures.Future`-like callback pair."""

    __slots__ = ("on_result", "on_error")

    def __init__(self, on_result: Callable[[Any], None], on_error: Callable[[BaseException], None]) -> None:
        self.on_result = on_result
        self.on_error = on_error

    def on_reply(self, msg: Any) -> bool:
        if isinstance(msg, ErrorReply):
            self.on_error(error_from_reply(msg))
        else:
            self.on_result(msg)
        return True

    def on_failure(self, error: BaseException) -> None:
        self.on_error(error)
