"""RolloutRouter: one endpoint in front of many engine replicas, speaking the server's protocol.

A client (`RolloutClient`, `AsyncRolloutClient`) cannot tell a router from a server: the same
messages, the same exactly-once rule for its request ids (`rollout.service.registry`), the same leases.
Behind it (`rollout.router.replicas`):

* placement (`rollout.router.placement`): a GRPO group on one replica, a session sticky to its replica,
  else the replica with the longest cached prefix (fed by its KV events), else the least loaded;
* control broadcast (`rollout.router.broadcast`): pause, continue, suspend, resume, weight updates and
  prefix-cache resets go to every replica and are answered once; new requests wait while a
  weight update is in flight, so no request starts on a mix of versions, and a request group
  (`group_id`) that started on one version is refused on another; `Stats` merges the replicas'
  figures and names each replica's state and policy version (`replica/<name>/...`);
* failover (`rollout.router.links`): a replica that dies or whose loop stalls is taken out, what
  it owed is sent to the others, and it is taken back, in step with the fleet (version, paused,
  suspended), once healthy; replicas come and go at run time (`add_replica` / `remove_replica`:
  spawned processes, Ray actors);
* partial rollouts: with `max_staleness` set, samples that would span too many policy versions
  are recomputed (or aborted, `StalePolicy`).

One thread (`serve_forever`) owns every socket: the clients' ROUTER and a DEALER per replica;
other threads reach it through a mailbox (`add_replica`, `replicas`, ...).
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec
import numpy as np
import zmq

from rollout.router.attempts import Route, StalePolicy
from rollout.router.broadcast import Fanout, merge_stats
from rollout.router.links import HealthConfig, ReplicaState
from rollout.router.placement import Placement, PlacementConfig
from rollout.router.replicas import KINDS, ReplicaSet
from rollout.service.leases import Leases
from rollout.service.metrics import ServiceMetrics
from rollout.service.registry import Record, RequestRegistry
from rollout.service.socket import FrontEnd
from rollout.wire.codec import DEFAULT_MAX_FRAME_BYTES, ProtocolError, encode
from rollout.wire.convert import sampling_params_from_wire
from rollout.wire.kinds import ErrorCode, Kind
from rollout.wire.mailbox import Mailbox
from rollout.wire.messages import (
    Abort,
    ErrorReply,
    Generate,
    Health,
    HealthInfo,
    Heartbeat,
    KvEvents,
    RequestMessage,
    Result,
    SampleOutput,
    TokenDelta,
)
from rollout.wire.security import ClientSecurity, ServerSecurity

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RouterConfig:
    """Where a router listens (as `ServerConfig`), how it watches replicas (`health`), how it
    places requests (`placement`), and how stale a partial rollout may get: `max_staleness`
    policy versions (None: no bound), and what happens past it (`stale_policy`)."""

    host: str = "127.0.0.1"
    port: int = 0
    lease_s: float = 10.0
    retain_s: float = 120.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    security: ServerSecurity = field(default_factory=ServerSecurity)
    replica_security: Optional[ClientSecurity] = None
    health: HealthConfig = field(default_factory=HealthConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    max_staleness: Optional[int] = None
    stale_policy: StalePolicy = StalePolicy.RECOMPUTE

    def __post_init__(self) -> None:
        for name in ("lease_s", "retain_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"RouterConfig.{name} must be > 0, got {value!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"RouterConfig.port must be in [0, 65535], got {self.port!r}")
        if self.max_staleness is not None and (not isinstance(self.max_staleness, int) or self.max_staleness < 0):
            raise ValueError(f"RouterConfig.max_staleness must be None or an int >= 0, got {self.max_staleness!r}")
        self.stale_policy = StalePolicy(self.stale_policy)


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """One replica, as `RolloutRouter.replicas()` reports it."""

    address: str
    state: ReplicaState
    reason: str
    policy_version: Optional[int]
    load_tokens: int
    in_flight: int
    routed: dict[str, int]
    takeouts: int


class RolloutRouter:
    """See module docstring. `replicas`: addresses (`tcp://host:port`) to start with.

    The constructor binds; `start()` serves on a thread of its own (or `serve_forever()` on the
    caller's) until `stop()`; `close()` releases the sockets (`with RolloutRouter(...)` does all).
    """

    def __init__(self, replicas: Sequence[str] = (), config: Optional[RouterConfig] = None) -> None:
        self.config = config = config or RouterConfig()
        self._ctx = zmq.Context()
        try:
            self.front = FrontEnd(self._ctx, config.host, config.port, config.security, config.max_frame_bytes)
        except BaseException:
            self._ctx.term()
            raise
        self.address: str = self.front.address
        self._mailbox = Mailbox()
        self.registry = RequestRegistry(retain_s=config.retain_s)
        self.leases = Leases(config.lease_s)
        self.metrics = ServiceMetrics()
        self._poller = zmq.Poller()
        self._poller.register(self.front.socket, zmq.POLLIN)
        self._poller.register(self._mailbox.fileno(), zmq.POLLIN)
        self.replica_set = ReplicaSet(self._ctx, self._poller, self, self.metrics, Placement(config.placement),
                                      config.health, max_staleness=config.max_staleness,
                                      stale_policy=config.stale_policy, security=config.replica_security,
                                      max_frame_bytes=config.max_frame_bytes, session=secrets.token_hex(6))
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._next_purge = 0.0
        self._last_round = time.monotonic()
        for address in replicas:
            self.replica_set.add(address)

    # ---- any thread ----------------------------------------------------------------------------

    def add_replica(self, address: str, name: Optional[str] = None) -> str:
        """Route to the replica at `address` once it answers healthy (and in step with the fleet);
        returns its name (unique for the router's life: a replacement gets a new one)."""
        return self._ask(lambda: self.replica_set.add(address, name))

    def remove_replica(self, name: str) -> None:
        """Stop routing to `name` now; what it owed goes to the others."""
        self._ask(lambda: self.replica_set.remove(name))

    def replicas(self) -> dict[str, ReplicaInfo]:
        return self._ask(self._infos)

    def wait_ready(self, count: int, timeout: float = 60.0) -> int:
        """Wait until `count` replicas are up (routable), at most `timeout` s; how many are."""
        deadline = time.monotonic() + timeout
        while True:
            up = sum(info.state is ReplicaState.UP for info in self.replicas().values())
            if up >= count or time.monotonic() >= deadline:
                return up
            time.sleep(0.02)

    def placements(self, request_id: str) -> list[str]:
        """The replicas a client's request was sent to, in order (for tests and debugging)."""
        return self._ask(lambda: list(r.stream.replicas) if (r := self.registry.get(request_id)) else [])

    def set_staleness(self, max_staleness: Optional[int], policy: Optional[StalePolicy] = None) -> None:
        """Change `RouterConfig.max_staleness` (and `stale_policy`) from now on (the next update)."""
        if max_staleness is not None and (not isinstance(max_staleness, int) or max_staleness < 0):
            raise ValueError(f"max_staleness must be None or an int >= 0, got {max_staleness!r}")

        def apply() -> None:
            self.replica_set.max_staleness = self.config.max_staleness = max_staleness
            if policy is not None:
                self.replica_set.stale_policy = self.config.stale_policy = StalePolicy(policy)

        self._ask(apply)

    def prefix_matches(self, prompt: Sequence[int]) -> dict[str, int]:
        """How many leading KV blocks of `prompt` each replica is believed to hold (as placement sees it)."""
        def matches() -> dict[str, int]:
            replicas, route = self.replica_set, Route()
            out = {}
            for name, link in replicas.links.items():
                hashes = route.prompt_hashes(np.asarray(prompt), link.block_size, replicas.fleet.version or 0) \
                    if link.block_size else []
                out[name] = replicas.placement.match(name, hashes)
            return out

        return self._ask(matches)

    def _ask(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        thread = self._thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            return fn()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._mailbox.put((fn, future))
        return future.result(timeout)

    def start(self) -> RolloutRouter:
        self._thread = threading.Thread(target=self.serve_forever, name="rollout-router", daemon=True)
        self._thread.start()
        return self

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the loop started by `start()` to end; True once it has."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the loop to end (safe from any thread, and from a signal handler)."""
        self._stopping.set()
        self._mailbox.put(None)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.replica_set.close()
        self.front.close()
        self._ctx.term()
        self._mailbox.close()

    def __enter__(self) -> RolloutRouter:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self.close()

    # ---- the router thread ---------------------------------------------------------------------

    def serve_forever(self) -> None:
        try:
            while not self._stopping.is_set():
                events = dict(self._poller.poll(10))
                now = time.monotonic()
                self._last_round = now
                try:
                    if self.front.socket in events:
                        self._read_clients(now)
                    for link in list(self.replica_set.links.values()):
                        if link.socket in events:
                            self.replica_set.read(link, now)
                    self._drain_mailbox()
                    self.replica_set.tick(now)
                    self._housekeeping(now)
                except Exception:  # NOTE: a bug of ours; the router must outlive it (logged, counted)
                    logger.exception("the router's loop failed a round; routing on")
                    self.metrics.error(ErrorCode.INTERNAL)
        finally:
            if self._thread is None or self._thread is threading.current_thread():
                self.close()

    def _drain_mailbox(self) -> None:
        for item in self._mailbox.drain():
            if item is None:
                continue
            fn, future = item
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 (handed to the caller)
                future.set_exception(exc)

    def _housekeeping(self, now: float) -> None:
        for peer in self.leases.expired(now):
            records = self.registry.live_of(peer)
            if records:
                logger.warning("client %s went silent: aborting its %d requests", peer.hex(), len(records))
                self.metrics.count("lease_aborted_requests", len(records))
                msg = Abort(request_id="lease-expired", targets=[r.request_id for r in records])
                self.replica_set.abort(records, Fanout(None, msg), now)
        if now >= self._next_purge:
            self._next_purge = now + 1.0
            self.registry.purge(now)

    # ---- clients -------------------------------------------------------------------------------

    def _read_clients(self, now: float) -> None:
        for peer, msg, error in self.front.receive():
            self.metrics.count("frames_received")
            self.leases.renew(peer, now, msg.lease_s if isinstance(msg, Heartbeat) else None)
            if error is not None:
                self.front.send_error(peer, error, self.metrics)
                continue
            try:
                self._dispatch_client(peer, msg, now)
            except ProtocolError as err:  # refused by rule (not found, duplicate, invalid sampling)
                self.front.send_error(peer, ErrorReply(code=err.code, message=err.message, request_id=msg.request_id),
                                      self.metrics)

    def _dispatch_client(self, peer: bytes, msg: RequestMessage, now: float) -> None:
        replicas = self.replica_set
        if isinstance(msg, Generate):
            self._generate(peer, msg, now)
        elif isinstance(msg, (Health, Heartbeat)):
            version = replicas.fleet.version or 0
            health = HealthInfo(healthy=bool(replicas.candidates()) or replicas.updating,
                                seconds_since_loop_tick=max(0.0, now - self._last_round),
                                state=replicas.fleet.engine_state, policy_version=version)
            self.front.send(peer, Result(request_id=msg.request_id, request_kind=KINDS[type(msg)],
                                         policy_version=version, health=health if isinstance(msg, Health) else None))
        elif isinstance(msg, Abort):
            records = [r for r in map(self.registry.get, msg.targets) if r is not None]
            if not records:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no request with id {msg.targets[0]!r}")
            replicas.abort(records, Fanout(peer, msg), now)
        elif isinstance(msg, KvEvents):
            raise ProtocolError(ErrorCode.INVALID_REQUEST, "a router holds no prefix cache: ask its replicas")
        else:
            replicas.broadcast(Fanout(peer, msg), now)

    def _generate(self, peer: bytes, msg: Generate, now: float) -> None:
        self.metrics.count("generates_received")
        record = self.registry.get(msg.request_id)
        if record is not None:
            if record.request != msg:
                raise ProtocolError(ErrorCode.DUPLICATE,
                                    f"request id {msg.request_id!r} is in use for a different request")
            self.metrics.count("resubmits")
            self.registry.move(record, peer)
            for frame in record.frames.values():  # NOTE: the client keeps the first copy of each
                self.front.send_frame(peer, frame)
            return
        sampling_params_from_wire(msg.sampling)  # refused here by the engine's rules, before a replica sees it
        fleet = self.replica_set.fleet.version
        group = self.replica_set.placement.group_of(msg.group_id)
        if group is not None and fleet is not None and group[1] != fleet:
            raise ProtocolError(ErrorCode.ENGINE_STATE, f"group {msg.group_id!r} started at policy version "
                                f"{group[1]}, the replicas now serve {fleet}: a group never mixes versions")
        record = self.registry.add(msg, peer)
        record.stream = Route()
        self.metrics.count("requests_run")
        self.replica_set.dispatch(record, list(range(record.n)), now)

    # ---- the replica set's sink ----------------------------------------------------------------

    def deliver(self, record: Record, out: SampleOutput, now: float) -> None:
        """A sample for the client (the first copy of each index is sent; the rest dropped)."""
        try:
            frame = encode(out, max_frame_bytes=self.config.max_frame_bytes)
        except ProtocolError as err:  # a sample too large for one frame: its request hears why
            frame = encode(ErrorReply(code=err.code, message=err.message, request_id=record.request_id))
        if self.registry.finish_sample(record, out.sample_index, frame, now):
            self.metrics.sample_sent(out.versions)
            self.front.send_frame(record.owner, frame)
            if record.done:
                self.metrics.count("requests_finished")

    def forward_tokens(self, record: Record, delta: TokenDelta) -> None:
        """Streamed tokens, each once: a resubmitted sample's repeats are cut.

        NOTE: a sample sampled again elsewhere (failover, recompute) restarts; with greedy or
        seeded sampling its tokens repeat and are cut here, otherwise later deltas may not
        continue earlier ones: the sample's final output is the one that counts.
        """
        route: Route = record.stream
        index = delta.sample_index
        have = route.sent_tokens.get(index, 0)
        end = delta.start + len(delta.token_ids)
        if index in record.frames or end <= have:
            return
        cut = max(0, have - delta.start)
        route.sent_tokens[index] = end
        self.front.send(record.owner, msgspec.structs.replace(
            delta, request_id=record.request_id, start=delta.start + cut, token_ids=delta.token_ids[cut:],
            logprobs=delta.logprobs[cut:], versions=delta.versions[cut:]))

    def refused(self, record: Record, reply: ErrorReply) -> None:
        self.registry.drop(record)
        self.front.send_error(record.owner, reply, self.metrics)

    def control_done(self, fan: Fanout) -> None:
        kind = KINDS[type(fan.msg)]
        fleet = self.replica_set.fleet
        if kind is Kind.STATS:
            reply = self._stats_reply(fan)
        elif kind is Kind.ABORT and not fan.parts:  # nothing of theirs was running anywhere
            reply = Result(request_id=fan.msg.request_id, request_kind=kind, policy_version=fleet.version or 0,
                           stats={"aborted": 0})
        else:
            reply = fan.outcome(kind, fleet.version)
            if kind in (Kind.PAUSE, Kind.SUSPEND, Kind.RESUME, Kind.UPDATE_WEIGHTS):
                self.metrics.count({Kind.PAUSE: "pauses", Kind.SUSPEND: "suspends", Kind.RESUME: "resumes",
                                    Kind.UPDATE_WEIGHTS: "weight_updates"}[kind])
        self.front.send(fan.peer, reply)

    # ---- figures -------------------------------------------------------------------------------

    def _stats_reply(self, fan: Fanout) -> Result:
        fleet = self.replica_set.fleet
        merged = merge_stats([fan.replies[r].stats or {} for r in fan.succeeded])
        merged.update(policy_version=fleet.version or 0, state=fleet.engine_state)
        extra: dict[str, Any] = {"replicas": len(self.replica_set.links),
                                 "replicas_up": len(self.replica_set.candidates())}
        for name, info in self._infos().items():
            prefix = f"replica/{name}/"
            extra.update({prefix + "state": info.state.value, prefix + "address": info.address,
                          prefix + "load_tokens": info.load_tokens, prefix + "in_flight": info.in_flight,
                          prefix + "takeouts": info.takeouts})
            if info.policy_version is not None:
                extra[prefix + "policy_version"] = info.policy_version
            extra.update({f"{prefix}routed_{reason}": n for reason, n in info.routed.items()})
        held = sum(len(indices) for _, indices in self.replica_set.held)
        stats = self.metrics.snapshot(merged, lane_depth=held, requests_in_flight=self.registry.num_live,
                                      clients=len(self.leases), extra=extra)
        return Result(request_id=fan.msg.request_id, request_kind=Kind.STATS, policy_version=fleet.version or 0,
                      stats=stats)

    def _infos(self) -> dict[str, ReplicaInfo]:
        return {name: ReplicaInfo(link.address, link.state, link.reason, link.version, load, len(link.attempts),
                                  routed, link.takeouts)
                for name, link, load, routed in self.replica_set.link_figures()}
