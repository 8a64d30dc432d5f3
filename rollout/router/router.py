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

One thread, the service endpoint's (`rollout.service.endpoint`, the same front a server runs:
exactly-once, leases, housekeeping), owns every socket: the clients' ROUTER and a DEALER per
replica; other threads reach it through its mailbox (`add_replica`, `replicas`, ...).
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec
import numpy as np

from inference.config import StalePolicy
from rollout.router.attempts import Route
from rollout.router.broadcast import Fanout, merge_stats
from rollout.router.links import HealthConfig, ReplicaState
from rollout.router.placement import Placement, PlacementConfig
from rollout.router.replicas import ReplicaSet
from rollout.service.endpoint import EndpointConfig, ServiceEndpoint
from rollout.service.registry import Record
from rollout.wire.codec import DEFAULT_MAX_FRAME_BYTES, ProtocolError
from rollout.wire.kinds import ErrorCode, Kind
from rollout.wire.messages import (
    REQUEST_TYPES,
    Abort,
    ErrorReply,
    Health,
    HealthInfo,
    Heartbeat,
    KvEvents,
    Result,
    SampleOutput,
    TokenDelta,
    kind_of,
)
from rollout.wire.security import ClientSecurity, ServerSecurity

logger = logging.getLogger(__name__)

# NOTE: above any replica's usual --max-seq-len, so the replicas' own limits decide below it; what
# it bounds is the router's own work on a prompt (its placement hashes every block of it)
DEFAULT_MAX_SEQUENCE_LENGTH = 2**17


@dataclass(slots=True)
class RouterConfig:
    """Where a router listens (as `ServerConfig`), how it watches replicas (`health`), how it
    places requests (`placement`), and how stale a partial rollout may get: `max_staleness`
    policy versions (None: no bound), and what happens past it (`stale_policy`).

    `max_sequence_length`: a Generate whose prompt + max_tokens is longer is refused here
    (CONTEXT_OVERFLOW), never forwarded; set it to the replicas' own (`rollout route --spawn`
    does). A shorter request a replica cannot fit is refused by that replica, just as cheaply.
    """

    host: str = "127.0.0.1"
    port: int = 0
    lease_s: float = 10.0
    max_lease_s: float = 60.0  # the longest lease a client's Heartbeat may set (cut to it)
    retain_s: float = 120.0
    max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    security: ServerSecurity = field(default_factory=ServerSecurity)
    replica_security: Optional[ClientSecurity] = None
    health: HealthConfig = field(default_factory=HealthConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    max_staleness: Optional[int] = None
    stale_policy: StalePolicy = StalePolicy.RECOMPUTE

    def __post_init__(self) -> None:
        for name in ("lease_s", "max_lease_s", "retain_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"RouterConfig.{name} must be > 0, got {value!r}")
        if self.max_lease_s < self.lease_s:
            raise ValueError(f"RouterConfig.max_lease_s must be >= lease_s ({self.lease_s!r}), "
                             f"got {self.max_lease_s!r}")
        if not (isinstance(self.max_sequence_length, int) and self.max_sequence_length >= 1):
            raise ValueError(f"RouterConfig.max_sequence_length must be an int >= 1, got {self.max_sequence_length!r}")
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
    serving_error: Optional[str] = None  # why its engine refuses generations though up (a deep sleep's weights)


class RolloutRouter:
    """See module docstring. `replicas`: addresses (`tcp://host:port`) to start with.

    The constructor binds; `start()` serves on a thread of its own (or `serve_forever()` on the
    caller's) until `stop()`; `close()` releases the sockets (`with RolloutRouter(...)` does all).
    """

    def __init__(self, replicas: Sequence[str] = (), config: Optional[RouterConfig] = None) -> None:
        self.config = config = config or RouterConfig()
        broadcast = {t: self._broadcast for t in REQUEST_TYPES if t.broadcast}
        handlers = {**broadcast, Health: self._health, Heartbeat: self._health, Abort: self._abort,
                    KvEvents: self._kv_events}
        endpoint_config = EndpointConfig(host=config.host, port=config.port, security=config.security,
                                         max_frame_bytes=config.max_frame_bytes, lease_s=config.lease_s,
                                         max_lease_s=config.max_lease_s, retain_s=config.retain_s, poll_ms=10,
                                         max_sequence_length=config.max_sequence_length)
        self.endpoint = ServiceEndpoint(endpoint_config, name="rollout-router", handlers=handlers,
                                        start_generate=self._generate, abort_silent=self._abort_silent,
                                        on_mail=self._on_mail, tick=self._tick)
        self.address: str = self.endpoint.address
        self.registry, self.leases, self.metrics = self.endpoint.registry, self.endpoint.leases, self.endpoint.metrics
        self.replica_set = ReplicaSet(self.endpoint.ctx, self.endpoint, self, self.metrics,
                                      Placement(config.placement), config.health, max_staleness=config.max_staleness,
                                      stale_policy=config.stale_policy, security=config.replica_security,
                                      max_frame_bytes=config.max_frame_bytes, session=secrets.token_hex(6))
        self.endpoint.on_close.append(self.replica_set.close)
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
        if self.endpoint.on_own_thread():
            return fn()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.endpoint.mailbox.put((fn, future))
        return future.result(timeout)

    def start(self) -> RolloutRouter:
        self.endpoint.start()
        return self

    def serve_forever(self) -> None:
        self.endpoint.serve_forever()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the loop started by `start()` to end; True once it has."""
        return self.endpoint.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the loop to end (safe from any thread, and from a signal handler)."""
        self.endpoint.stop(timeout)

    def close(self) -> None:
        self.endpoint.close()

    def __enter__(self) -> RolloutRouter:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self.close()

    # ---- the router's thread -------------------------------------------------------------------

    def _on_mail(self, items: list[Any], now: float) -> None:
        for fn, future in items:
            try:
                future.set_result(fn())
            except Exception as exc:  # noqa: BLE001 (handed to the caller)
                future.set_exception(exc)

    def _tick(self, now: float) -> None:
        self.replica_set.tick(now)

    def _abort_silent(self, records: list[Record], now: float) -> None:
        msg = Abort(request_id="lease-expired", targets=[r.request_id for r in records])
        self.replica_set.abort(records, Fanout(None, msg), now)

    # ---- clients (the handlers of the endpoint's table) ----------------------------------------

    def _health(self, peer: bytes, msg: Any, now: float) -> None:
        replicas = self.replica_set
        version = replicas.fleet.version or 0
        health = HealthInfo(healthy=bool(replicas.candidates()) or replicas.updating,
                            seconds_since_loop_tick=max(0.0, now - self.endpoint.last_round),
                            state=replicas.fleet.engine_state, policy_version=version,
                            serving_error=replicas.serving_error())
        self.endpoint.send(peer, Result(request_id=msg.request_id, request_kind=kind_of(type(msg)),
                                        policy_version=version, health=health if isinstance(msg, Health) else None))

    def _abort(self, peer: bytes, msg: Abort, now: float) -> None:
        records = [r for r in map(self.registry.get, msg.targets) if r is not None]
        if not records:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no request with id {msg.targets[0]!r}")
        self.replica_set.abort(records, Fanout(peer, msg), now)

    def _kv_events(self, peer: bytes, msg: KvEvents, now: float) -> None:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "a router holds no prefix cache: ask its replicas")

    def _broadcast(self, peer: bytes, msg: Any, now: float) -> None:
        self.replica_set.broadcast(Fanout(peer, msg), now)

    def _generate(self, record: Record, params: Any, now: float) -> None:
        msg = record.request
        fleet = self.replica_set.fleet.version
        group = self.replica_set.placement.group_of(msg.group_id)
        if group is not None and fleet is not None and group[1] != fleet:
            self.endpoint.refuse(record, ErrorReply(
                code=ErrorCode.ENGINE_STATE, request_id=msg.request_id,
                message=f"group {msg.group_id!r} started at policy version {group[1]}, the replicas now serve "
                        f"{fleet}: a group never mixes versions"))
            return
        record.stream = Route()
        self.replica_set.dispatch(record, list(range(record.n)), now)

    # ---- the replica set's sink ----------------------------------------------------------------

    def deliver(self, record: Record, out: SampleOutput, now: float) -> None:
        """A sample for the client (the first copy of each index is sent; the rest dropped)."""
        self.endpoint.deliver(record, out, now)

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
        self.endpoint.send(record.owner, msgspec.structs.replace(
            delta, request_id=record.request_id, start=delta.start + cut, token_ids=delta.token_ids[cut:],
            logprobs=delta.logprobs[cut:], versions=delta.versions[cut:]))

    def refused(self, record: Record, reply: ErrorReply) -> None:
        self.endpoint.refuse(record, reply)

    def control_done(self, fan: Fanout) -> None:
        kind = kind_of(type(fan.msg))
        fleet = self.replica_set.fleet
        if kind is Kind.STATS:
            reply = self._stats_reply(fan)
        elif kind is Kind.ABORT and not fan.parts:  # nothing of theirs was running anywhere
            reply = Result(request_id=fan.msg.request_id, request_kind=kind, policy_version=fleet.version or 0,
                           stats={"aborted": 0})
        else:
            reply = fan.outcome(kind, fleet.version)
            if fan.msg.counted_as and isinstance(reply, Result):
                self.metrics.count(fan.msg.counted_as)
        if isinstance(reply, ErrorReply):
            self.endpoint.send_error(fan.peer, reply)
        else:
            self.endpoint.send(fan.peer, reply)

    # ---- figures -------------------------------------------------------------------------------

    def _stats_reply(self, fan: Fanout) -> Result:
        fleet = self.replica_set.fleet
        merged = merge_stats([fan.replies[r].stats or {} for r in fan.succeeded])
        merged.update(policy_version=fleet.version or 0, state=fleet.engine_state.value)
        extra: dict[str, Any] = {"replicas": len(self.replica_set.links),
                                 "replicas_up": len(self.replica_set.candidates()),
                                 # the replicas a weight group's broadcast reaches: up, and lagging ones
                                 "replicas_weight_group": sum(link.state is ReplicaState.UP
                                                              for link in self.replica_set.links.values())
                                 + len(self.replica_set.lagging(time.monotonic()))}
        for name, info in self._infos().items():
            prefix = f"replica/{name}/"
            extra.update({prefix + "state": info.state.value, prefix + "address": info.address,
                          prefix + "load_tokens": info.load_tokens, prefix + "in_flight": info.in_flight,
                          prefix + "takeouts": info.takeouts})
            if info.policy_version is not None:
                extra[prefix + "policy_version"] = info.policy_version
            if info.serving_error is not None:
                extra[prefix + "serving_error"] = info.serving_error
            extra.update({f"{prefix}routed_{reason}": n for reason, n in info.routed.items()})
        held = sum(len(indices) for _, indices in self.replica_set.held)
        stats = self.metrics.snapshot(merged, held=held, requests_in_flight=self.registry.num_live,
                                      clients=len(self.leases), extra=extra)
        return Result(request_id=fan.msg.request_id, request_kind=Kind.STATS, policy_version=fleet.version or 0,
                      stats=stats)

    def _infos(self) -> dict[str, ReplicaInfo]:
        return {name: ReplicaInfo(link.address, link.state, link.reason, link.version, load, len(link.attempts),
                                  routed, link.takeouts, link.health.serving_error if link.health else None)
                for name, link, load, routed in self.replica_set.link_figures()}
