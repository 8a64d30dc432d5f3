"""ServiceSocket: a service's client-facing ROUTER socket, bound and secured.

Binding refuses a non-loopback address without credentials (`rollout.wire.security`); frames are
decoded and checked by the wire's rules (a bad one comes back as the `ErrorReply` naming the
problem); replies never block and are never dropped for a slow reader. The endpoint's thread
alone touches it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Optional

import zmq

from rollout.wire.codec import ProtocolError, decode_request, encode
from rollout.wire.convert import error_reply
from rollout.wire.kinds import ErrorCode
from rollout.wire.messages import ErrorReply, RequestMessage
from rollout.wire.security import ServerSecurity, check_bind, secure_server_socket

logger = logging.getLogger(__name__)


class ServiceSocket:
    """The ROUTER socket at `address` (see module docstring)."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, security: ServerSecurity, max_frame_bytes: int) -> None:
        check_bind(host, security)
        self.max_frame_bytes = max_frame_bytes
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.linger = 0
        self.socket.sndhwm = 0  # NOTE: never drop a reply for a slow reader: samples are owed exactly once
        self.socket.maxmsgsize = 2 * max_frame_bytes
        if ":" in host:
            self.socket.ipv6 = True
        self._auth = secure_server_socket(ctx, self.socket, security)
        shown = f"[{host}]" if ":" in host else host
        try:
            self.socket.bind(f"tcp://{shown}:{port or '*'}")
        except zmq.ZMQError:
            self.close()
            raise
        self.address: str = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def receive(self, budget: int = 256) -> Iterator[tuple[bytes, Optional[RequestMessage], Optional[ErrorReply]]]:
        """Up to `budget` requests waiting: (peer, message, None), or (peer, None, the refusal)."""
        for _ in range(budget):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer, body = frames[0].bytes, frames[1:]
            try:
                if len(body) != 1:
                    raise ProtocolError(ErrorCode.MALFORMED,
                                        f"a request is one frame after the routing id, got {len(body)}")
                yield peer, decode_request(body[0].buffer, self.max_frame_bytes), None
            except ProtocolError as err:
                yield peer, None, error_reply(err)

    def send(self, peer: bytes, msg: Any) -> None:
        self.send_frame(peer, encode(msg, max_frame_bytes=self.max_frame_bytes))

    def send_frame(self, peer: bytes, frame: bytes) -> None:
        try:
            self.socket.send_multipart([peer, frame], zmq.NOBLOCK, copy=len(frame) < 65536)
        except zmq.ZMQError as exc:  # NOTE: a ROUTER drops frames to unknown peers silently; this is rarer
            logger.warning("reply to %s dropped: %s", peer.hex(), exc)

    def close(self) -> None:
        self.socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
