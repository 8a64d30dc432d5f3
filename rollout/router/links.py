"""ReplicaLink: one engine replica as a router sees it: its socket, its health, its version.

A router holds one DEALER socket per replica, touched only by the router's thread (no thread of
its own here: the router polls every link's socket together with its clients'). The router
(`rollout.router.replicas`) polls each replica's `Health` every `HealthConfig.every_s` (which also
renews its lease there) and its prefix-cache events (`KvEvents`) every `kv_every_s`; the link
judges from the replies:

* JOINING: added, not yet heard healthy. Nothing is routed to it.
* UP: routed to. It is taken out (DOWN) when it has been silent for `dead_after_s` (a dead
  process, a cut network: a ROUTER / DEALER pair sees no disconnect), or when its engine loop
  has not gone round for `stall_deadline_s` (a wedged loop: the server answers Health without
  the engine, so a hang shows), or when a command the router broadcast failed on it.
* SYNCING: heard healthy again (or for the first time) but not in step with the fleet (policy
  version, paused, suspended): the router sends what brings it in line, then it is UP.
* DOWN: out; its unfinished requests were resubmitted elsewhere. It stays polled, and is
  taken back (through SYNCING) once it answers healthy again.

`verdict(now)` is pure over the replies seen and the clock, so it is tested without sockets.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass
from typing import Optional

import zmq

from inference.core.states import EngineState
from rollout.wire.messages import HealthInfo
from rollout.wire.security import ClientSecurity, secure_client_socket

logger = logging.getLogger(__name__)


class ReplicaState(str, enum.Enum):
    JOINING = "joining"
    SYNCING = "syncing"
    UP = "up"
    DOWN = "down"


@dataclass(slots=True)
class HealthConfig:
    """How a router watches its replicas (see module docstring); keep `stall_deadline_s` above
    the longest engine step, and `dead_after_s` a few polls long."""

    every_s: float = 0.25
    dead_after_s: float = 3.0
    stall_deadline_s: float = 5.0
    kv_every_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("every_s", "dead_after_s", "stall_deadline_s", "kv_every_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"HealthConfig.{name} must be > 0, got {value!r}")
        if self.dead_after_s <= self.every_s:
            raise ValueError(f"HealthConfig.dead_after_s ({self.dead_after_s}) must exceed every_s ({self.every_s})")


class ReplicaLink:
    """One replica (see module docstring). The router's thread alone calls its methods.

    Invariants: `attempts` holds the router-side ids of the Generates this replica runs for the
    router and that the router still waits for; nothing is routed to a link that is not UP.
    """

    def __init__(self, name: str, address: str, ctx: zmq.Context, config: HealthConfig, now: float, *,
                 security: Optional[ClientSecurity] = None, max_frame_bytes: int = 64 * 2**20) -> None:
        self.name = name
        self.address = address
        self.config = config
        self.state = ReplicaState.JOINING
        self.reason = "joining"
        self.version: Optional[int] = None
        self.engine_state: Optional[EngineState] = None  # from Health
        self.block_size: Optional[int] = None
        self.health: Optional[HealthInfo] = None
        self.added_at = now
        self.last_heard: Optional[float] = None
        self.down_since: Optional[float] = None
        self.retry_at = now  # no sync before this (after a failed one)
        self.next_health = now
        self.next_kv = now
        self.kv_cursor = 0
        self.kv_waiting = False  # a KvEvents poll is out
        self.attempts: set[str] = set()
        self.takeouts = 0
        self._backlog: deque[bytes] = deque()
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.sndhwm = 0
        self.socket.rcvhwm = 0
        self.socket.maxmsgsize = 2 * max_frame_bytes
        self.socket.immediate = True  # NOTE: nothing queues inside ZMQ for a replica that is not connected
        if "[" in address:
            self.socket.ipv6 = True
        secure_client_socket(self.socket, security)
        self.socket.connect(address)

    # ---- sending -------------------------------------------------------------------------------

    def send(self, frame: bytes, droppable: bool = False) -> None:
        """Never blocks (a DEALER whose peer is gone would): what the socket does not take waits,
        in order, and is dropped if the replica is taken out; a `droppable` frame (a poll) is
        dropped at once instead, so polls do not pile up for a replica that is gone."""
        if not self._backlog:
            try:
                self.socket.send(frame, zmq.NOBLOCK, copy=len(frame) < 65536)
                return
            except zmq.Again:
                pass
        if not droppable:
            self._backlog.append(frame)

    def flush(self) -> None:
        while self._backlog:
            try:
                self.socket.send(self._backlog[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._backlog.popleft()

    def drop_backlog(self) -> int:
        dropped = len(self._backlog)
        self._backlog.clear()
        return dropped

    # ---- health --------------------------------------------------------------------------------

    def heard(self, now: float, version: Optional[int] = None) -> None:
        self.last_heard = now
        if version is not None:
            self.version = version

    def on_health(self, info: HealthInfo, now: float) -> None:
        self.heard(now, info.policy_version)
        self.health = info
        self.engine_state = info.state
        if self.state is ReplicaState.UP:  # NOTE: routed to, but say so where its engine refuses to generate
            self.reason = "up" if info.serving_error is None else f"up, not generating: {info.serving_error}"

    def looks_healthy(self, now: float) -> bool:
        """Heard from lately, with a loop that goes round (whatever the state)."""
        return self.verdict(now) is None and self.health is not None

    def verdict(self, now: float) -> Optional[str]:
        """Why this replica should be out now, or None. Silence counts from the last reply (or
        from when the link was added / last taken out, if none came since)."""
        since = self.last_heard if self.last_heard is not None else self.added_at
        if self.down_since is not None and (self.last_heard is None or self.last_heard < self.down_since):
            since = self.down_since
        if now - since > self.config.dead_after_s:
            return f"silent for {now - since:.1f} s"
        info = self.health
        if info is None:
            return None
        if info.seconds_since_loop_tick > self.config.stall_deadline_s:
            return f"engine loop stalled ({info.seconds_since_loop_tick:.1f} s since it went round)"
        # NOTE: `info.healthy` is the server's judgement by its own deadline; the router's is the one above
        return None

    def take_out(self, reason: str, now: float) -> None:
        self.state = ReplicaState.DOWN
        self.reason = reason
        self.down_since = now
        self.health = None  # NOTE: only a reply after this may bring it back
        self.kv_waiting = False
        self.kv_cursor = 0  # NOTE: its cache view was dropped; a restarted process numbers its events anew
        self.takeouts += 1
        self.drop_backlog()

    def close(self) -> None:
        self.socket.close(linger=0)
