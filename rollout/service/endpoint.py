"""ServiceEndpoint: what every ZMQ service (an engine server, a router) runs in front of itself.

One thread (`serve_forever`) owns the client-facing ROUTER socket (`rollout.service.socket`) and
every socket an owner registers with `watch`; other threads reach it through `mailbox`. Each
round it reads client frames, the watched sockets, the mailbox (handed to the owner's `on_mail`),
runs the owner's `tick`, and keeps house (leases, the registry's retention). What it does for
every owner alike:

* every frame renews its sender's lease (a Heartbeat may set its length, cut to `max_lease_s`);
  a frame that fails to decode is answered by an `ErrorReply` naming the problem;
* each request goes to the one handler of its message class (`handlers`); a refusal by rule
  (`ProtocolError`) or a bug (any other exception, logged) is answered by an `ErrorReply`, and
  nothing else in flight is touched;
* `Generate` is exactly-once here, for every owner: its length is checked at the door, before any
  conversion (prompt + max_tokens over `max_sequence_length` is CONTEXT_OVERFLOW, permanent: a
  prompt as large as a frame allows must not cost a copy, nor reach the engine or a replica),
  its sampling is checked by the engine's rules (`SamplingParams`), a resubmission of a held id
  goes to its newest sender with the samples that already finished, an id reused for a different
  request is refused (`DUPLICATE`), and a new one is registered and handed to the owner's
  `start_generate(record, params, now)`;
* `deliver` sends a finished sample once (the registry keeps its frame for resubmissions);
* a client whose lease ran out has its unfinished requests handed to `abort_silent`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq

from inference import SamplingParams
from inference.errors import ContextOverflowError, MaxSequenceLengthOverflowError
from rollout.service.leases import Leases
from rollout.service.metrics import ServiceMetrics
from rollout.service.registry import Record, RequestRegistry
from rollout.service.socket import ServiceSocket
from rollout.wire.codec import DEFAULT_MAX_FRAME_BYTES, ProtocolError, encode
from rollout.wire.convert import error_reply
from rollout.wire.kinds import ErrorCode
from rollout.wire.mailbox import Mailbox
from rollout.wire.messages import REQUEST_TYPES, ErrorReply, Generate, Heartbeat, SampleOutput
from rollout.wire.security import ServerSecurity

logger = logging.getLogger(__name__)

Handler = Callable[[bytes, Any, float], None]


@dataclass(slots=True)
class EndpointConfig:
    """Where a service listens and how long it keeps what clients are owed (see `ServerConfig`)."""

    host: str = "127.0.0.1"
    port: int = 0
    security: ServerSecurity = field(default_factory=ServerSecurity)
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    lease_s: float = 10.0
    max_lease_s: float = 60.0  # the longest lease a client's Heartbeat may set (longer ones are cut to it)
    max_sequence_length: Optional[int] = None  # a Generate's prompt + max_tokens past it is refused (None: any)
    retain_s: float = 120.0
    poll_ms: int = 100  # the longest a round waits for a frame or mail


class ServiceEndpoint:
    """See module docstring. The constructor binds; `handlers` maps every request class but
    `Generate` (the endpoint's own) to the owner's handler, each exactly once."""

    def __init__(self, config: EndpointConfig, *, name: str, handlers: Mapping[type, Handler],
                 start_generate: Callable[[Record, SamplingParams, float], None],
                 abort_silent: Callable[[list[Record], float], None],
                 on_mail: Callable[[list[Any], float], None] = lambda items, now: None,
                 tick: Callable[[float], None] = lambda now: None,
                 ctx: Optional[zmq.Context] = None) -> None:
        table = {Generate: self._generate, **handlers}
        missing = [t.__name__ for t in REQUEST_TYPES if t not in table]
        if missing or len(table) != len(REQUEST_TYPES):
            raise ValueError(f"{name}: no handler for {missing}" if missing else f"{name}: handlers for non-requests")
        self.config, self.name, self.handlers = config, name, table
        self._start_generate, self._abort_silent = start_generate, abort_silent
        self._on_mail, self._tick = on_mail, tick
        self._owns_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        try:
            self.socket = ServiceSocket(self.ctx, config.host, config.port, config.security, config.max_frame_bytes)
        except BaseException:
            if self._owns_ctx:
                self.ctx.term()
            raise
        self.address = self.socket.address
        self.mailbox = Mailbox()
        self.registry = RequestRegistry(retain_s=config.retain_s)
        self.leases = Leases(config.lease_s, config.max_lease_s)
        self.metrics = ServiceMetrics()
        self.poller = zmq.Poller()
        self.poller.register(self.socket.socket, zmq.POLLIN)
        self.poller.register(self.mailbox.fileno(), zmq.POLLIN)
        self._watched: dict[Any, Callable[[float], None]] = {}
        self.last_round = time.monotonic()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._next_purge = 0.0
        self.on_close: list[Callable[[], None]] = []  # the owner's own shutdown, before the sockets go

    # ---- life cycle (any thread) ---------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name=self.name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> Optional[threading.Thread]:
        return self._thread

    def on_own_thread(self) -> bool:
        """Whether the caller may touch the endpoint's state directly (its thread, or none runs)."""
        thread = self._thread
        return thread is None or not thread.is_alive() or thread is threading.current_thread()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the loop to end (safe from any thread, and from a signal handler)."""
        self._stopping.set()
        self.mailbox.put(None)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def wait(self, timeout: Optional[float] = None) -> bool:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fn in self.on_close:
            try:
                fn()
            except Exception:  # noqa: BLE001 (one part's failure must not keep the sockets open)
                logger.exception("%s: closing a part failed", self.name)
        self.socket.close()
        if self._owns_ctx:
            self.ctx.term()
        self.mailbox.close()

    # ---- the endpoint's thread -----------------------------------------------------------------

    def watch(self, socket: Any, on_readable: Callable[[float], None]) -> None:
        self.poller.register(socket, zmq.POLLIN)
        self._watched[socket] = on_readable

    def unwatch(self, socket: Any) -> None:
        self.poller.unregister(socket)
        self._watched.pop(socket, None)

    def serve_forever(self) -> None:
        try:
            while not self._stopping.is_set():
                events = dict(self.poller.poll(self.config.poll_ms))
                now = self.last_round = time.monotonic()
                try:
                    if self.socket.socket in events:
                        self._read(now)
                    for socket, on_readable in list(self._watched.items()):
                        if socket in events:
                            on_readable(now)
                    items = [item for item in self.mailbox.drain() if item is not None]
                    if items:
                        self._on_mail(items, now)
                    self._tick(now)
                    self._housekeeping(now)
                except Exception:  # NOTE: a bug of ours; the service must outlive it (it is logged and counted)
                    logger.exception("%s: a round failed; serving on", self.name)
                    self.metrics.error(ErrorCode.INTERNAL)
        finally:
            self.close()

    def _read(self, now: float) -> None:
        for peer, msg, refusal in self.socket.receive():
            self.metrics.count("frames_received")
            asked = msg.lease_s if isinstance(msg, Heartbeat) else None
            if self.leases.renew(peer, now, asked):
                logger.warning("%s: client %s asked for a %g s lease: cut to max_lease_s=%g s", self.name,
                               peer.hex(), asked, self.config.max_lease_s)
            if refusal is not None:
                self.send_error(peer, refusal)
                continue
            try:
                self.handlers[type(msg)](peer, msg, now)
            except (ProtocolError, ContextOverflowError) as err:  # refused by rule (not found, too long, ...)
                self.send_error(peer, error_reply(err, msg.request_id))
            except Exception as exc:  # noqa: BLE001 (a bug of ours must not end the service; the sender hears it)
                logger.exception("%s: serving %s failed", self.name, type(msg).__name__)
                self.send_error(peer, error_reply(exc, msg.request_id))

    def _generate(self, peer: bytes, msg: Generate, now: float) -> None:
        self.metrics.count("generates_received")
        _check_length(msg, self.config.max_sequence_length)
        record = self.registry.get(msg.request_id)
        if record is not None:
            if record.request != msg:
                raise ProtocolError(ErrorCode.DUPLICATE,
                                    f"request id {msg.request_id!r} is in use for a different request")
            self.metrics.count("resubmits")
            self.registry.move(record, peer)
            for frame in record.frames.values():  # NOTE: the client keeps the first copy of each
                self.socket.send_frame(peer, frame)
            return
        params = _session_params(msg)
        record = self.registry.add(msg, peer)
        self.metrics.count("requests_run")
        self._start_generate(record, params, now)

    def _housekeeping(self, now: float) -> None:
        for peer in self.leases.expired(now):
            self.metrics.count("lease_expiries")
            records = self.registry.live_of(peer)
            if records:
                logger.warning("%s: client %s went silent: aborting its %d requests", self.name, peer.hex(),
                               len(records))
                self.metrics.count("lease_aborted_requests", len(records))
                self._abort_silent(records, now)
        if now >= self._next_purge:
            self._next_purge = now + 1.0
            self.registry.purge(now)

    # ---- outgoing (the endpoint's thread) ------------------------------------------------------

    def send(self, peer: Optional[bytes], msg: Any) -> None:
        if peer is not None:
            self.socket.send(peer, msg)

    def send_error(self, peer: Optional[bytes], reply: ErrorReply) -> None:
        self.metrics.error(reply.code)
        if peer is not None:
            self.socket.send_frame(peer, encode(reply))

    def deliver(self, record: Record, sample: SampleOutput, now: float) -> None:
        """A finished sample for its client: sent once (the first copy of each index), its frame
        kept for a resubmission; one too large for a frame is its request's error instead."""
        try:
            frame = encode(sample, max_frame_bytes=self.config.max_frame_bytes)
        except ProtocolError as err:
            frame = encode(error_reply(err, record.request_id))
        if self.registry.finish_sample(record, sample.sample_index, frame, now):
            self.metrics.sample_sent(sample.versions)
            self.socket.send_frame(record.owner, frame)
            if record.done:
                self.metrics.count("requests_finished")

    def refuse(self, record: Record, reply: ErrorReply) -> None:
        """A Generate the engine (or every replica) refused: forgotten, so a resubmission runs it again."""
        self.registry.drop(record)
        self.send_error(record.owner, reply)


def _session_params(msg: Generate) -> SamplingParams:
    """The Generate's sampling, in its session (`Generate.session_id`) where the sampling names none."""
    if msg.sampling.session_id is not None or not msg.session_id:
        return msg.sampling
    try:
        return dataclasses.replace(msg.sampling, session_id=msg.session_id)
    except ValueError as exc:  # the engine's messages start with the field's name
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"sampling.{exc}", msg.request_id) from None


def _check_length(msg: Generate, max_sequence_length: Optional[int]) -> None:
    """The engine's own length rule (`prompt + max_tokens <= max_sequence_length`), read off the
    packed prompt's size: O(1) whatever its length."""
    prompt, max_tokens = msg.prompt_token_ids.size, msg.sampling.max_tokens
    if max_sequence_length is not None and prompt + max_tokens > max_sequence_length:
        raise MaxSequenceLengthOverflowError(
            None, f"prompt ({prompt}) + max_tokens ({max_tokens}) > max_sequence_length ({max_sequence_length})")


__all__ = ["EndpointConfig", "Handler", "ServiceEndpoint"]
