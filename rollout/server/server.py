"""RolloutServer: one engine behind a ZMQ ROUTER socket, safe against whatever arrives on it.

Threads (ZMQ sockets are not thread-safe: only the endpoint's thread touches the ROUTER):

* the endpoint's thread (`rollout.service.endpoint`) reads frames, decodes and checks them,
  keeps the request registry (exactly-once) and the client leases, and encodes and sends every
  reply. It never waits on the engine: Health is answered from the loop's last tick, KvEvents
  from the prefix-cache event log (`rollout.server.kv_log`, for routers), and every engine call
  is posted to the engine's loop (`rollout.server.dispatch`), its one command queue;
* the engine's own loop steps and runs those calls between steps; its stream callbacks and the
  calls' done-callbacks only put items into the endpoint's mailbox, which wakes its thread;
* the weight receiver's worker runs weight transfers (which wait on their sender), so
  generation goes on until the commit.

Every frame gets an answer: a bad one an `ErrorReply` naming the problem (and the request id
when it could be read), a Generate its `n` `SampleOutput`s (after `TokenDelta`s if it asked),
any other request one `Result`. Nothing else in flight is touched by a bad frame. A frame over
`max_frame_bytes` is answered TOO_LARGE; one over twice that is cut by ZMQ itself
(`MAXMSGSIZE`), which drops that connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from inference import DynamicInferenceEngine, RequestOutput, SamplingParams, TokenEvent
from rollout.server.dispatch import CallReply, ServerCalls
from rollout.server.kv_log import KvEventLog
from rollout.service.endpoint import EndpointConfig, ServiceEndpoint
from rollout.service.engine_service import HEALTH_DEADLINE_S, EngineService
from rollout.service.metrics import _wire_values
from rollout.service.registry import Record
from rollout.wire.codec import DEFAULT_MAX_FRAME_BYTES
from rollout.wire.convert import error_reply, output_to_wire
from rollout.wire.messages import Abort, Result, TokenDelta, kind_of
from rollout.wire.security import ServerSecurity, is_loopback
from weight_sync import DiskAccess, Staging, WeightReceiver

logger = logging.getLogger(__name__)

MAX_BATCH = 1024  # Generates handed to the engine in one command


@dataclass(slots=True)
class ServerConfig:
    """Where a server listens and how it treats its clients.

    `lease_s`: how long a client may stay silent before its requests are aborted (a Heartbeat
    may set its own, cut to `max_lease_s`). `health_deadline_s`: a loop quiet for longer is reported unhealthy (keep it
    above the longest step). `retain_s`: how long a finished request's samples are kept for a
    client that resubmits it after a reconnect. `weight_staging`: how weight updates that do not
    choose are staged (`double`: the old weights serve until the commit; `in_place`: no second
    copy, no generation until a complete update); `weight_sync_timeout_s` bounds their waits.
    `disk_access`: which directories disk weight updates may read (None: any on loopback, none
    beyond it; `rollout serve --weights-root`).
    """

    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port (read `RolloutServer.address`)
    lease_s: float = 10.0
    max_lease_s: float = 60.0
    health_deadline_s: float = HEALTH_DEADLINE_S
    retain_s: float = 120.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    security: ServerSecurity = field(default_factory=ServerSecurity)
    weight_staging: Staging = Staging.DOUBLE
    weight_sync_timeout_s: float = 60.0
    disk_access: Optional[DiskAccess] = None

    def __post_init__(self) -> None:
        self.weight_staging = Staging(self.weight_staging)
        for name in ("lease_s", "max_lease_s", "health_deadline_s", "retain_s", "weight_sync_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"ServerConfig.{name} must be > 0, got {value!r}")
        if self.max_lease_s < self.lease_s:
            raise ValueError(f"ServerConfig.max_lease_s must be >= lease_s ({self.lease_s!r}), "
                             f"got {self.max_lease_s!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServerConfig.port must be in [0, 65535], got {self.port!r}")
        if self.max_frame_bytes < 1024:
            raise ValueError(f"ServerConfig.max_frame_bytes must be >= 1024, got {self.max_frame_bytes!r}")

    def endpoint(self) -> EndpointConfig:
        return EndpointConfig(host=self.host, port=self.port, security=self.security,
                              max_frame_bytes=self.max_frame_bytes, lease_s=self.lease_s, max_lease_s=self.max_lease_s,
                              retain_s=self.retain_s)


class RolloutServer:
    """Serves `engine` on `config.host:config.port` (see module docstring).

    The constructor binds (refusing a non-loopback address without credentials) and starts the
    engine's loop if it is not running; `serve_forever()` runs the socket loop on the calling
    thread until `stop()`, or `start()` runs it on a thread of its own. `close()` (done by
    `serve_forever` on its way out) releases the socket and stops the loop it started.
    """

    def __init__(self, engine: DynamicInferenceEngine, config: Optional[ServerConfig] = None) -> None:
        self.config = config = config or ServerConfig()
        self.engine = engine
        self.calls = ServerCalls(self)
        self._queued: list[tuple[Record, SamplingParams]] = []  # Generates read this round, not yet posted
        endpoint_config = config.endpoint()
        endpoint_config.max_sequence_length = engine.config.max_sequence_length  # NOTE: checked before any copy
        self.endpoint = ServiceEndpoint(endpoint_config, name="rollout-server", handlers=self.calls.table(),
                                        start_generate=self._queue_generate, abort_silent=self._abort_silent,
                                        on_mail=self._on_mail, tick=lambda now: self.flush_generates())
        self.address: str = self.endpoint.address
        self.registry, self.leases, self.metrics = self.endpoint.registry, self.endpoint.leases, self.endpoint.metrics
        self.kv_log = KvEventLog(engine.config.block_size)
        engine.add_kv_event_listener(self.kv_log)
        self._owns_loop = not engine.loop_running
        if self._owns_loop:
            engine.start()
        disk_access = (config.disk_access if config.disk_access is not None
                       else DiskAccess.of((), beyond_loopback=not is_loopback(config.host)))
        self.receiver = WeightReceiver(engine, staging=config.weight_staging, timeout_s=config.weight_sync_timeout_s,
                                       disk_access=disk_access)
        self.service = EngineService(engine, self.receiver, self.config.health_deadline_s)
        self.endpoint.on_close.append(self._close_parts)

    # ---- life cycle ----------------------------------------------------------------------------

    def start(self) -> RolloutServer:
        """Serve on a background thread (in-process use); `stop()` ends it."""
        self.endpoint.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the socket loop to end (safe from any thread, and from a signal handler)."""
        self.endpoint.stop(timeout)

    def serve_forever(self) -> None:
        self.endpoint.serve_forever()

    def close(self) -> None:
        self.endpoint.close()

    def _close_parts(self) -> None:
        self.receiver.close()
        if self._owns_loop:
            try:
                self.engine.stop()
            except TimeoutError:
                logger.warning("the engine loop did not stop (wedged?); leaving it")

    # ---- generation ----------------------------------------------------------------------------

    def _queue_generate(self, record: Record, params: SamplingParams, now: float) -> None:
        self._queued.append((record, params))
        if len(self._queued) >= MAX_BATCH:
            self.flush_generates()

    def flush_generates(self) -> None:
        """Post the Generates read so far to the engine's loop as one `submit_each`."""
        if not self._queued:
            return
        batch, self._queued = self._queued, []
        engine, post = self.engine, self.endpoint.mailbox.put

        def submit() -> list[Any]:  # NOTE: on the loop: each record's stream is set before any later call runs
            results = engine.submit_each(
                [r.request.prompt_token_ids.tolist() for r, _ in batch], [p for _, p in batch],
                stream_tokens=[r.request.stream_tokens for r, _ in batch],
                callbacks=[lambda item, record=r: post((record, item)) for r, _ in batch],
                clients=[r.admission_client for r, _ in batch],  # NOTE: the engine admits them in turns
                defer_compiles=True)  # NOTE: a new grammar is built off the loop; its prompt admitted after
            for (record, _), result in zip(batch, results):
                if not isinstance(result, Exception):
                    record.stream = result
            return results

        def refusals(done: Any) -> None:  # NOTE: on the loop; mail only for refusals, so an accepted batch wakes no one
            if done.exception() is not None or any(isinstance(r, Exception) for r in done.result()):
                post(_Submitted(batch, done))

        self.engine.post(submit).add_done_callback(refusals)

    def stats_snapshot(self, figures: dict) -> dict:
        endpoint = self.endpoint
        return endpoint.metrics.snapshot(figures, held=len(self._queued),
                                         requests_in_flight=endpoint.registry.num_live,
                                         clients=len(endpoint.leases), extra=self.receiver.stats.wire())

    def _abort_silent(self, records: list[Record], now: float) -> None:
        self.calls.abort(None, Abort(request_id="lease-expired", targets=[r.request_id for r in records]), now,
                         records)

    # ---- the mailbox (the endpoint's thread) ---------------------------------------------------

    def _on_mail(self, items: list[Any], now: float) -> None:
        tokens: dict[tuple[int, int], tuple[Record, list[TokenEvent]]] = {}
        for item in items:
            try:
                if type(item) is tuple:
                    record, out = item
                    if isinstance(out, Exception):  # NOTE: a deferred admission's refusal (its grammar's)
                        self.endpoint.refuse(record, error_reply(out, record.request_id))
                        continue
                    if isinstance(out, TokenEvent):
                        tokens.setdefault((id(record), out.sample_index), (record, []))[1].append(out)
                        continue
                    self._flush_tokens(tokens)
                    self._sample_finished(record, out, now)
                else:
                    _MAIL[type(item)](self, item)
            except Exception:  # NOTE: one item's failure must not lose the others drained with it
                logger.exception("handling %s failed", type(item).__name__)
        self._flush_tokens(tokens)

    def _flush_tokens(self, tokens: dict[tuple[int, int], tuple[Record, list[TokenEvent]]]) -> None:
        for record, events in tokens.values():
            delta = TokenDelta(request_id=record.request_id, sample_index=events[0].sample_index,
                               start=events[0].index, token_ids=[e.token_id for e in events],
                               logprobs=[e.logprob for e in events], versions=[e.version for e in events])
            self.endpoint.send(record.owner, delta)
        tokens.clear()

    def _sample_finished(self, record: Record, out: RequestOutput, now: float) -> None:
        self.endpoint.deliver(record, output_to_wire(out, record.request_id, n=record.n), now)

    def _submitted(self, item: _Submitted) -> None:
        error = item.future.exception()
        results = [error] * len(item.batch) if error is not None else item.future.result()
        for (record, _), result in zip(item.batch, results):
            if isinstance(result, Exception):
                self.endpoint.refuse(record, error_reply(result, record.request_id))

    def _reply(self, item: CallReply) -> None:
        error = item.future.exception()
        if item.peer is None:  # an abort of a silent client's requests: nobody to answer
            return
        if error is not None:
            self.endpoint.send_error(item.peer, error_reply(error, item.msg.request_id))
            return
        if item.msg.counted_as:
            self.metrics.count(item.msg.counted_as)
        fields = item.render(item.future.result())
        if "stats" in fields:
            fields["stats"] = _wire_values(fields["stats"])
        self.endpoint.send(item.peer, Result(request_id=item.msg.request_id, request_kind=kind_of(type(item.msg)),
                                             policy_version=self.engine.policy_version, **fields))


@dataclass(slots=True)
class _Submitted:
    """The engine took (or refused, one by one) a batch of Generates."""

    batch: list[tuple[Record, SamplingParams]]
    future: Any


# the posted calls' mail, each to its one handler (a sample's output or tokens: `_on_mail` itself)
_MAIL: dict[type, Callable[[RolloutServer, Any], None]] = {
    _Submitted: RolloutServer._submitted, CallReply: RolloutServer._reply,
}
