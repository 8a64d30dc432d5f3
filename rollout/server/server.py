"""RolloutServer: one engine behind a ZMQ ROUTER socket, safe against whatever arrives on it.

Threads (ZMQ sockets are not thread-safe: only the socket thread touches the ROUTER):

* the socket thread (`serve_forever`) reads frames, decodes and checks them, keeps the request
  registry (exactly-once, `rollout.service.registry`) and the client leases (`rollout.service.leases`), and
  encodes and sends every reply. It never waits on the engine: Health is answered from the
  loop's last tick, KvEvents from the prefix-cache event log (`rollout.server.kv_log`, for routers),
  everything that needs the engine goes to the lane;
* the engine lane (`rollout.server.lane`) makes the engine calls in arrival order;
* the engine's own background loop steps; its stream callbacks only put `(record, item)` into
  the server's mailbox, which wakes the socket thread (`rollout.wire.mailbox`).

Every frame gets an answer: a bad one an `ErrorReply` naming the problem (and the request id
when it could be read), a Generate its `n` `SampleOutput`s (after `TokenDelta`s if it asked),
any other request one `Result`. Nothing else in flight is touched by a bad frame. A frame over
`max_frame_bytes` is answered TOO_LARGE; one over twice that is cut by ZMQ itself
(`MAXMSGSIZE`), which drops that connection.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq

from inference import DynamicInferenceEngine, RequestOutput, TokenEvent
from rollout.server.kv_log import KvEventLog
from rollout.server.lane import Done, EngineLane, Submitted
from rollout.service.leases import Leases
from rollout.service.metrics import ServiceMetrics, _wire_values
from rollout.service.registry import Record, RequestRegistry
from rollout.wire.codec import DEFAULT_MAX_FRAME_BYTES, ProtocolError, decode_request, encode
from rollout.wire.convert import error_reply, output_to_wire, sampling_params_from_wire
from rollout.wire.kinds import ErrorCode, Kind
from rollout.wire.mailbox import Mailbox
from rollout.wire.messages import (
    Abort,
    ErrorReply,
    Generate,
    GetWeightVersion,
    Health,
    HealthInfo,
    Heartbeat,
    KvEvents,
    Pause,
    RequestMessage,
    Result,
    Resume,
    Stats,
    Suspend,
    TokenDelta,
    UpdateWeights,
)
from rollout.wire.security import ServerSecurity, check_bind, secure_server_socket
from weight_sync import Staging, WeightReceiver

logger = logging.getLogger(__name__)

_COUNTED = {Pause: "pauses", Suspend: "suspends", Resume: "resumes", UpdateWeights: "weight_updates"}


@dataclass(slots=True)
class ServerConfig:
    """Where a server listens and how it treats its clients.

    `lease_s`: how long a client may stay silent before its requests are aborted (a Heartbeat
    may set its own). `health_deadline_s`: a loop quiet for longer is reported unhealthy (keep it
    above the longest step). `retain_s`: how long a finished request's samples are kept for a
    client that resubmits it after a reconnect. `weight_staging`: how weight updates that do not
    choose are staged (`double`: the old weights serve until the commit; `in_place`: no second
    copy, no generation until a complete update); `weight_sync_timeout_s` bounds their waits.
    """

    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port (read `RolloutServer.address`)
    lease_s: float = 10.0
    health_deadline_s: float = 10.0
    retain_s: float = 120.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    security: ServerSecurity = field(default_factory=ServerSecurity)
    weight_staging: Staging = Staging.DOUBLE
    weight_sync_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        self.weight_staging = Staging(self.weight_staging)
        for name in ("lease_s", "health_deadline_s", "retain_s", "weight_sync_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"ServerConfig.{name} must be > 0, got {value!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig.port must be in [0, 65535], got {self.port!r}")
        if self.max_frame_bytes < 1024:
            raise ValueError(f"ServerConfig.max_frame_bytes must be >= 1024, got {self.max_frame_bytes!r}")


class RolloutServer:
    """Serves `engine` on `config.host:config.port` (see module docstring).

    The constructor binds (refusing a non-loopback address without credentials) and starts the
    engine's loop if it is not running; `serve_forever()` runs the socket loop on the calling
    thread until `stop()`, or `start()` runs it on a thread of its own. `close()` (done by
    `serve_forever` on its way out) releases the socket and stops the loop it started.
    """

    def __init__(self, engine: DynamicInferenceEngine, config: Optional[ServerConfig] = None) -> None:
        self.config = config = config or ServerConfig()
        check_bind(config.host, config.security)
        self.engine = engine
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.linger = 0
        self._router.sndhwm = 0  # NOTE: never drop a reply for a slow reader: samples are owed exactly once
        self._router.maxmsgsize = 2 * config.max_frame_bytes
        if ":" in config.host:
            self._router.ipv6 = True
        self._auth = secure_server_socket(self._ctx, self._router, config.security)
        host = f"[{config.host}]" if ":" in config.host else config.host
        try:
            self._router.bind(f"tcp://{host}:{config.port or '*'}")
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._mailbox = Mailbox()
        self.registry = RequestRegistry(retain_s=config.retain_s)
        self.leases = Leases(config.lease_s)
        self.metrics = ServiceMetrics()
        self.kv_log = KvEventLog(engine.config.block_size)
        engine.add_kv_event_listener(self.kv_log)
        self._owns_loop = not engine.loop_running
        if self._owns_loop:
            engine.start()
        self.receiver = WeightReceiver(engine, staging=config.weight_staging, timeout_s=config.weight_sync_timeout_s)
        self._lane = EngineLane(engine, self._mailbox.put, receiver=self.receiver)
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._next_purge = 0.0

    # ---- life cycle ----------------------------------------------------------------------------

    def start(self) -> RolloutServer:
        """Serve on a background thread (in-process use); `stop()` ends it."""
        self._thread = threading.Thread(target=self.serve_forever, name="rollout-server", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the socket loop to end (safe from any thread, and from a signal handler)."""
        self._stopping.set()
        self._mailbox.put(None)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._mailbox.fileno(), zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                events = dict(poller.poll(100))
                now = time.monotonic()
                try:
                    if self._router in events:
                        self._read_router(now)
                    self._drain_mailbox(now)
                    self._housekeeping(now)
                except Exception:  # NOTE: a bug of ours; the server must outlive it (it is logged and counted)
                    logger.exception("the server's socket loop failed a round; serving on")
                    self.metrics.error(ErrorCode.INTERNAL)
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lane.stop()
        self.receiver.close()
        if self._owns_loop:
            try:
                self.engine.stop()
            except TimeoutError:
                logger.warning("the engine loop did not stop (wedged?); leaving it")
        self._close_sockets()
        self._mailbox.close()

    def _close_sockets(self) -> None:
        self._router.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # ---- incoming ------------------------------------------------------------------------------

    def _read_router(self, now: float, budget: int = 256) -> None:
        for _ in range(budget):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames[0].bytes, frames[1:], now)

    def _handle(self, peer: bytes, body: list[Any], now: float) -> None:
        self.metrics.count("frames_received")
        try:
            if len(body) != 1:
                raise ProtocolError(ErrorCode.MALFORMED,
                                    f"a request is one frame after the routing id, got {len(body)}")
            msg = decode_request(body[0].buffer, self.config.max_frame_bytes)
        except ProtocolError as err:
            self.leases.renew(peer, now)
            self._send_error(peer, error_reply(err))
            return
        self.leases.renew(peer, now, msg.lease_s if isinstance(msg, Heartbeat) else None)
        try:
            self._dispatch(peer, msg, now)
        except ProtocolError as err:  # refused by rule (not found, duplicate, invalid sampling)
            self._send_error(peer, error_reply(err, msg.request_id))
        except Exception as exc:  # noqa: BLE001 (a bug of ours must not end the server; the sender hears it)
            logger.exception("serving %s failed", type(msg).__name__)
            self._send_error(peer, error_reply(exc, msg.request_id))

    def _dispatch(self, peer: bytes, msg: RequestMessage, now: float) -> None:
        if isinstance(msg, Generate):
            self._generate(peer, msg)
        elif isinstance(msg, GetWeightVersion):  # NOTE: answered without the engine, as Health
            self._send(peer, Result(request_id=msg.request_id, request_kind=Kind.GET_WEIGHT_VERSION,
                                    policy_version=self.engine.policy_version))
        elif isinstance(msg, Health):
            self._send(peer, Result(request_id=msg.request_id, request_kind=Kind.HEALTH,
                                    policy_version=self.engine.policy_version, health=self.health()))
        elif isinstance(msg, KvEvents):
            # NOTE: a hash takes at most 9 bytes of msgpack, an event's framing 3 more
            batch = self.kv_log.read(msg.since, msg.max_events, max_hashes=(self.config.max_frame_bytes - 512) // 12)
            self._send(peer, Result(request_id=msg.request_id, request_kind=Kind.KV_EVENTS,
                                    policy_version=self.engine.policy_version, kv_events=batch))
        elif isinstance(msg, Heartbeat):
            self._send(peer, Result(request_id=msg.request_id, request_kind=Kind.HEARTBEAT,
                                    policy_version=self.engine.policy_version))
        elif isinstance(msg, Abort):
            known = [r for r in map(self.registry.get, msg.targets) if r is not None]
            if not known:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no request with id {msg.targets[0]!r}"
                                    + (f" (nor {len(msg.targets) - 1} more)" if len(msg.targets) > 1 else ""))
            self._lane.control(peer, msg, known)
        else:
            self._lane.control(peer, msg)

    def _generate(self, peer: bytes, msg: Generate) -> None:
        self.metrics.count("generates_received")
        record = self.registry.get(msg.request_id)
        if record is not None:
            if record.request != msg:
                raise ProtocolError(ErrorCode.DUPLICATE,
                                    f"request id {msg.request_id!r} is in use for a different request")
            self.metrics.count("resubmits")
            self.registry.move(record, peer)
            for frame in record.frames.values():  # NOTE: the client keeps the first copy of each
                self._send_frame(peer, frame)
            return
        params = sampling_params_from_wire(msg.sampling)
        record = self.registry.add(msg, peer)
        self.metrics.count("requests_run")
        post = self._mailbox.put
        self._lane.generate(record, msg.prompt_token_ids.tolist(), params,
                            lambda item, record=record: post((record, item)))

    def health(self) -> HealthInfo:
        """From the loop's last tick; never waits for the engine (a wedged loop must show)."""
        since = self.engine.seconds_since_loop_tick()
        since = float("inf") if since is None else since
        healthy = since <= self.config.health_deadline_s and self._lane.alive
        return HealthInfo(healthy=healthy, seconds_since_loop_tick=min(since, 1e9), state=self.engine.state.value,
                          policy_version=self.engine.policy_version)

    # ---- from the engine and the lane ----------------------------------------------------------

    def _drain_mailbox(self, now: float) -> None:
        tokens: dict[tuple[int, int], tuple[Record, list[TokenEvent]]] = {}
        for item in self._mailbox.drain():
            try:
                if type(item) is tuple:
                    record, out = item
                    if isinstance(out, TokenEvent):
                        tokens.setdefault((id(record), out.sample_index), (record, []))[1].append(out)
                        continue
                    self._flush_tokens(tokens)
                    self._sample_finished(record, out, now)
                elif isinstance(item, Submitted):
                    self._submitted(item)
                elif isinstance(item, Done):
                    self._done(item)
            except Exception:  # NOTE: one item's failure must not lose the others drained with it
                logger.exception("handling %s failed", type(item).__name__)
                self.metrics.error(ErrorCode.INTERNAL)
        self._flush_tokens(tokens)

    def _flush_tokens(self, tokens: dict[tuple[int, int], tuple[Record, list[TokenEvent]]]) -> None:
        for record, events in tokens.values():
            delta = TokenDelta(request_id=record.request_id, sample_index=events[0].sample_index,
                               start=events[0].index, token_ids=[e.token_id for e in events],
                               logprobs=[e.logprob for e in events], versions=[e.version for e in events])
            self._send(record.owner, delta)
        tokens.clear()

    def _sample_finished(self, record: Record, out: RequestOutput, now: float) -> None:
        wire = output_to_wire(out, record.request_id, n=record.n)
        try:
            frame = encode(wire, max_frame_bytes=self.config.max_frame_bytes)
        except ProtocolError as err:  # a sample too large for one frame: its request hears why
            frame = encode(error_reply(err, record.request_id))
        if self.registry.finish_sample(record, out.sample_index, frame, now):
            self.metrics.sample_sent(wire.versions)
            self._send_frame(record.owner, frame)
            if record.done:
                self.metrics.count("requests_finished")

    def _submitted(self, item: Submitted) -> None:
        if item.error is None:
            return
        record = item.record
        self.registry.drop(record)
        self._send_error(record.owner, error_reply(item.error, record.request_id))

    def _done(self, item: Done) -> None:
        msg = item.msg
        if item.peer is None:  # an abort of a silent client's requests: nobody to answer
            return
        if item.error is not None:
            self._send_error(item.peer, error_reply(item.error, msg.request_id))
            return
        name = _COUNTED.get(type(msg))
        if name:
            self.metrics.count(name)
        result = Result(request_id=msg.request_id, request_kind=_KINDS[type(msg)],
                        policy_version=self.engine.policy_version)
        if isinstance(msg, Stats):
            result.stats = self.metrics.snapshot(item.value, lane_depth=self._lane.depth(),
                                                 requests_in_flight=self.registry.num_live,
                                                 clients=len(self.leases), extra=self.receiver.stats.wire())
        elif isinstance(item.value, dict):
            result.stats = _wire_values(item.value)
        self._send(item.peer, result)

    # ---- housekeeping --------------------------------------------------------------------------

    def _housekeeping(self, now: float) -> None:
        for peer in self.leases.expired(now):
            records = self.registry.live_of(peer)
            self.metrics.count("lease_expiries")
            if records:
                logger.warning("client %s went silent: aborting its %d requests", peer.hex(), len(records))
                self.metrics.count("lease_aborted_requests", len(records))
                self._lane.control(None, Abort(request_id="lease-expired", targets=[r.request_id for r in records]),
                                   records)
        if now >= self._next_purge:
            self._next_purge = now + 1.0
            self.registry.purge(now)

    # ---- outgoing ------------------------------------------------------------------------------

    def _send(self, peer: bytes, msg: Any) -> None:
        self._send_frame(peer, encode(msg, max_frame_bytes=self.config.max_frame_bytes))

    def _send_error(self, peer: bytes, reply: ErrorReply) -> None:
        self.metrics.error(reply.code)
        self._send_frame(peer, encode(reply))

    def _send_frame(self, peer: bytes, frame: bytes) -> None:
        try:
            self._router.send_multipart([peer, frame], zmq.NOBLOCK, copy=len(frame) < 65536)
        except zmq.ZMQError as exc:  # NOTE: a ROUTER drops frames to unknown peers silently; this is rarer
            logger.warning("reply to %s dropped: %s", peer.hex(), exc)


_KINDS = {cls: Kind(cls.__struct_config__.tag) for cls in RequestMessage.__args__}

