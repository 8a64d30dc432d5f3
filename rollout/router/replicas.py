"""ReplicaSet: a router's replicas: health, failover, placement of attempts, replies.

The router's thread alone drives it (`tick`, `read`), with the router as its `Sink` for what
goes back to clients. What it keeps:

* one `ReplicaLink` per replica (`rollout.router.links`: socket, health verdict, version);
* the attempts running on them (`rollout.router.attempts`); a replica taken out (dead, stalled, failed
  a broadcast, removed) has its attempts given up (an Abort is sent, in case it comes back) and
  their owed samples dispatched to the others, or held until one can take them;
* the fleet's state (`rollout.router.broadcast.FleetState`) and the control broadcasts in flight: a
  weight update holds new dispatches until every replica answered, so no request starts on a
  mix of versions; a replica found on another version is taken out and synced back;
* placement (`rollout.router.placement`), fed with each replica's KV events;
* staleness: after an update, attempts started more than `max_staleness` versions ago are
  recomputed (given up and dispatched again) or aborted; a finished sample that still spans too
  many versions is recomputed or comes back aborted (`StalePolicy`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Optional, Protocol

import msgspec
import zmq

from inference.config import StalePolicy
from inference.request import FinishReason
from rollout.router.attempts import (
    Attempt,
    Route,
    aborted_sample,
    attempt_request,
    sent_indices,
    too_stale,
)
from rollout.router.broadcast import Fanout, FleetState
from rollout.router.broadcast_driver import ControlBroadcast
from rollout.router.links import HealthConfig, ReplicaLink, ReplicaState
from rollout.router.placement import Placement
from rollout.service.metrics import ServiceMetrics
from rollout.service.registry import Record
from rollout.wire.codec import ProtocolError, decode_reply, encode
from rollout.wire.messages import (
    Abort,
    ErrorReply,
    Health,
    KvEvents,
    RequestMessage,
    Result,
    SampleOutput,
    TokenDelta,
)
from rollout.wire.security import ClientSecurity

logger = logging.getLogger(__name__)


class Sink(Protocol):
    """Where a ReplicaSet sends what belongs to clients (the router)."""

    def deliver(self, record: Record, out: SampleOutput, now: float) -> None: ...

    def forward_tokens(self, record: Record, delta: TokenDelta) -> None: ...

    def refused(self, record: Record, reply: ErrorReply) -> None: ...

    def control_done(self, fan: Fanout) -> None: ...


class ReplicaSet(ControlBroadcast):
    """See module docstring. Invariant: every attempt in `attempts` is in its link's `attempts`
    and its record's route, and its cost is counted in the placement's load of its replica."""

    def __init__(self, ctx: zmq.Context, watch: Any, sink: Sink, metrics: ServiceMetrics,
                 placement: Placement, health: HealthConfig, *, max_staleness: Optional[int] = None,
                 stale_policy: StalePolicy = StalePolicy.RECOMPUTE, security: Optional[ClientSecurity] = None,
                 max_frame_bytes: int = 64 * 2**20, session: str = "router") -> None:
        # NOTE: `watch` is the endpoint's: it polls each link's socket with its own and calls back
        self._ctx, self._watch, self._sink, self.metrics = ctx, watch, sink, metrics
        self.placement, self.health = placement, health
        self.max_staleness, self.stale_policy = max_staleness, StalePolicy(stale_policy)
        self.security, self.max_frame_bytes, self._session = security, max_frame_bytes, session
        self.fleet = FleetState()
        self.links: dict[str, ReplicaLink] = {}
        self.attempts: dict[str, Attempt] = {}
        self.held: deque[tuple[Record, list[int]]] = deque()
        self._polls: dict[str, str] = {}  # health / kv poll id -> replica
        self._parts: dict[str, tuple[str, Fanout]] = {}  # control id sent to a replica -> (replica, fanout)
        self._syncing: dict[str, int] = {}  # replica -> sync messages not yet answered
        self._updating = 0  # weight-update broadcasts in flight
        self._ids = itertools.count()
        self._names = itertools.count()

    def next_id(self, prefix: str) -> str:
        return f"{self._session}-{prefix}{next(self._ids)}"

    # ---- membership ----------------------------------------------------------------------------

    def add(self, address: str, name: Optional[str] = None) -> str:
        name = name or f"r{next(self._names)}"
        if name in self.links:
            raise ValueError(f"a replica named {name!r} is already routed to")
        link = ReplicaLink(name, address, self._ctx, self.health, time.monotonic(), security=self.security,
                           max_frame_bytes=self.max_frame_bytes)
        self.links[name] = link
        self._watch.watch(link.socket, lambda now, link=link: self.read(link, now))
        self.placement.add(name)
        for what in ("h", "k"):
            self._polls[f"{self._session}-{what}-{name}"] = name
        return name

    def remove(self, name: str) -> None:
        link = self.links.get(name)
        if link is None:
            return
        self.take_out(link, "removed", time.monotonic())
        self._watch.unwatch(link.socket)
        link.close()
        del self.links[name]
        self.placement.remove(name)

    def close(self) -> None:
        for link in self.links.values():
            link.close()

    @property
    def updating(self) -> bool:
        """A weight-update broadcast is in flight (new requests wait)."""
        return self._updating > 0

    def serving_error(self) -> Optional[str]:
        """Why the fleet cannot generate though replicas are up: every candidate's engine refuses
        (their weights discarded by a deep sleep, say), the first one's reason; else None."""
        errors = [link.health.serving_error if link.health else None for link in map(self.links.get, self.candidates())]
        return errors[0] if errors and all(errors) else None

    def candidates(self) -> list[str]:
        """Replicas a request may start on: up, on the fleet's policy version, no update in flight."""
        if self._updating:
            return []
        version = self.fleet.version
        return [n for n, link in self.links.items() if link.state is ReplicaState.UP and link.version == version]

    # ---- the router's round --------------------------------------------------------------------

    def tick(self, now: float) -> None:
        cfg = self.health
        for link in list(self.links.values()):
            link.flush()
            if now >= link.next_health:
                link.next_health = now + cfg.every_s
                link.send(encode(Health(request_id=f"{self._session}-h-{link.name}")), droppable=True)
            if link.state is not ReplicaState.DOWN and (now >= link.next_kv and not link.kv_waiting
                                                         or now >= link.next_kv + cfg.dead_after_s):
                link.kv_waiting, link.next_kv = True, now + cfg.kv_every_s  # NOTE: a lost poll is sent again
                link.send(encode(KvEvents(request_id=f"{self._session}-k-{link.name}", since=link.kv_cursor)),
                          droppable=True)
            if link.state in (ReplicaState.UP, ReplicaState.SYNCING):
                reason = link.verdict(now)
                if reason is not None:
                    self.take_out(link, reason, now)
                elif link.state is ReplicaState.UP and not self._updating and link.version != self.fleet.version:
                    self._version_moved(link, now)
            elif not self._updating and now >= link.retry_at and link.looks_healthy(now):
                self._sync(link, now)
        if self.held and self.candidates():
            held, self.held = self.held, deque()
            for record, indices in held:
                self.dispatch(record, indices, now)

    def take_out(self, link: ReplicaLink, reason: str, now: float) -> None:
        """Route nothing more to `link`; what it owed goes to the others (module docstring)."""
        if link.state is ReplicaState.DOWN:
            return
        was_up = link.state is ReplicaState.UP
        (logger.warning if was_up else logger.info)("replica %s (%s) out: %s", link.name, link.address, reason)
        link.take_out(reason, now)
        self.metrics.count("takeouts" if was_up else "sync_failures")
        self._syncing.pop(link.name, None)
        self.placement.forget_cache(link.name)
        for rid, (replica, fan) in list(self._parts.items()):
            if replica == link.name:
                del self._parts[rid]
                fan.drop(replica)
                if fan.done:
                    self._fanout_done(fan, now)
        owed = [self.attempts[a] for a in list(link.attempts)]
        if owed:  # NOTE: in case it comes back (a stalled loop): it must not finish them for nobody
            link.send(encode(Abort(request_id=self.next_id("x"), targets=[a.id for a in owed])))
        for attempt in owed:
            self._retire(attempt)
            self.metrics.count("failovers")
            self.dispatch(attempt.record, attempt.owed(), now)

    def _version_moved(self, link: ReplicaLink, now: float) -> None:
        """A replica changed version outside the router's broadcasts (a trainer pushed weights to
        it, another router updated it): a newer version becomes the fleet's (the others are taken
        out until an update reaches them), an older one is taken out and synced."""
        fleet = self.fleet
        if link.version is not None and (fleet.version is None or link.version > fleet.version):
            logger.warning("replica %s moved to policy version %s outside the router: the fleet follows",
                           link.name, link.version)
            fleet.version, fleet.last_update = link.version, None  # NOTE: the last update no longer leads there
            self.metrics.count("versions_adopted")
        else:
            self.take_out(link, f"at policy version {link.version}, the fleet at {fleet.version}", now)

    def _sync(self, link: ReplicaLink, now: float) -> None:
        """Bring a healthy replica in step with the fleet (`FleetState.sync_plan`), then route to it."""
        if self.fleet.version is None:
            self.fleet.version = link.version  # NOTE: the first replica heard sets the fleet's version
        plan = self.fleet.sync_plan(link.version, link.engine_state, lambda: self.next_id("s"))
        if plan is None:
            link.retry_at = now + 5 * self.health.every_s
            link.reason = f"policy version {link.version}, the fleet's is {self.fleet.version}: no update to replay"
            return
        if not plan:
            if link.state is not ReplicaState.UP:
                logger.info("replica %s (%s) up at policy version %s", link.name, link.address, link.version)
            link.state, link.reason = ReplicaState.UP, "up"
            return
        link.state, link.reason = ReplicaState.SYNCING, f"syncing: {', '.join(type(m).__name__ for m in plan)}"
        self._syncing[link.name] = len(plan)
        for msg in plan:
            self.send_part(link, Fanout(None, msg, on_done=lambda fan, link=link: self._sync_step(link, fan)), msg)

    def _sync_step(self, link: ReplicaLink, fan: Fanout) -> None:
        now = time.monotonic()
        if link.name not in self._syncing:
            return
        if fan.failed or fan.absent:
            reply = fan.replies.get(link.name)
            self.take_out(link, f"could not sync: {getattr(reply, 'message', 'no reply')}", now)
            link.retry_at = now + 5 * self.health.every_s
            return
        self._syncing[link.name] -= 1
        if self._syncing[link.name] == 0:
            del self._syncing[link.name]
            self._sync(link, now)  # NOTE: the fleet may have moved on meanwhile: check again

    # ---- requests ------------------------------------------------------------------------------

    def dispatch(self, record: Record, indices: list[int], now: float) -> None:
        """Send the record's samples `indices` to a replica, or hold them until one can take them."""
        route: Route = record.stream
        indices = [i for i in indices if i not in record.frames]
        if not indices:
            return
        if route.aborted:
            for i in indices:
                self._sink.deliver(record, aborted_sample(record, i), now)
            return
        candidates = self.candidates()
        if not candidates:
            self.metrics.count("held")
            self.held.append((record, indices))
            return
        msg = record.request
        block_size = self.links[candidates[0]].block_size
        hashes = route.prompt_hashes(msg.prompt_token_ids, block_size, self.fleet.version,
                                     msg.sampling.cache_salt) if block_size else []
        name, reason = self.placement.choose(candidates, hashes, session_id=msg.session_id, group_id=msg.group_id)
        link = self.links[name]
        sent, wanted = sent_indices(record, indices)
        attempt = Attempt(self.next_id("g"), record, name, sent, link.version, len(msg.prompt_token_ids),
                          msg.sampling.max_tokens, wanted=None if wanted is None else {sent.index(i) for i in wanted})
        link.send(encode(attempt_request(record, attempt.id, len(sent)), max_frame_bytes=self.max_frame_bytes))
        self.attempts[attempt.id] = attempt
        link.attempts.add(attempt.id)
        route.attempts[attempt.id] = attempt
        route.replicas.append(name)
        self.placement.assign(name, reason, attempt.cost, hashes, session_id=msg.session_id, group_id=msg.group_id,
                              version=link.version)

    def _retire(self, attempt: Attempt) -> None:
        """Forget an attempt: its later replies are dropped, its load released."""
        if self.attempts.pop(attempt.id, None) is None:
            return
        self.placement.release(attempt.replica, attempt.cost)
        link = self.links.get(attempt.replica)
        if link is not None:
            link.attempts.discard(attempt.id)
        attempt.record.stream.attempts.pop(attempt.id, None)

    def abort(self, records: list[Record], fan: Fanout, now: float) -> None:
        """Finish these records' owed samples now (as `abort`): the replicas running them are asked
        to, the held ones end at once; `fan` collects the replicas' answers."""
        by_replica: dict[str, list[str]] = {}
        for record in records:
            route: Route = record.stream
            route.aborted = True
            for attempt in route.attempts.values():
                attempt.aborting = True
                by_replica.setdefault(attempt.replica, []).append(attempt.id)
        for held in [h for h in self.held if h[0].stream.aborted]:
            self.held.remove(held)
            self.dispatch(held[0], held[1], now)  # NOTE: an aborted route ends its owed samples at once
        for name, ids in by_replica.items():
            self.send_part(self.links[name], fan, Abort(request_id=fan.msg.request_id, targets=ids))
        if fan.done:
            self._fanout_done(fan, now)

    def send_part(self, link: ReplicaLink, fan: Fanout, msg: RequestMessage) -> None:
        part_id = self.next_id("c")
        fan.add(link.name, part_id)
        self._parts[part_id] = (link.name, fan)
        link.send(encode(msgspec.structs.replace(msg, request_id=part_id), max_frame_bytes=self.max_frame_bytes))

    # ---- replies -------------------------------------------------------------------------------

    def read(self, link: ReplicaLink, now: float, budget: int = 512) -> None:
        for _ in range(budget):
            try:
                frame = link.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = decode_reply(frame.buffer, self.max_frame_bytes)
            except ProtocolError as err:
                logger.error("unreadable reply from replica %s: %s", link.name, err)
                continue
            link.heard(now)
            rid = msg.request_id
            attempt = self.attempts.get(rid) if rid is not None else None
            if attempt is not None:
                self._attempt_reply(attempt, msg, now)
            elif rid in self._polls:
                self._poll_reply(link, msg, now)
            elif rid in self._parts:
                name, fan = self._parts.pop(rid)
                if isinstance(msg, Result):
                    link.heard(now, msg.policy_version)
                fan.on_reply(name, msg)
                if fan.done:
                    self._fanout_done(fan, now)
            else:
                self.metrics.count("late_replies")  # an attempt given up, a fire-and-forget abort

    def _poll_reply(self, link: ReplicaLink, msg: Any, now: float) -> None:
        if not isinstance(msg, Result):
            logger.warning("replica %s refused a poll: %s", link.name, getattr(msg, "message", msg))
            link.kv_waiting = False
            return
        if msg.health is not None:
            link.on_health(msg.health, now)
        batch = msg.kv_events
        if batch is not None and link.kv_waiting:
            link.kv_waiting = False
            link.block_size = batch.block_size
            self.placement.kv_events(link.name, batch.events, reset=batch.reset)
            link.kv_cursor = batch.next
            if batch.more:
                link.next_kv = now

    def _attempt_reply(self, attempt: Attempt, msg: Any, now: float) -> None:
        handle = _ATTEMPT_REPLIES.get(type(msg))
        if handle is not None:
            handle(self, attempt, msg, now)

    def _attempt_sample(self, attempt: Attempt, msg: SampleOutput, now: float) -> None:
        record = attempt.record
        j = msg.sample_index
        if j not in attempt.left:
            return
        before = attempt.cost
        attempt.left.discard(j)
        self.placement.release(attempt.replica, before - attempt.cost)
        if not attempt.left:
            self._retire(attempt)
            if attempt.runs_extra:  # NOTE: nobody waits for the rest of it: free the replica
                self.links[attempt.replica].send(encode(Abort(request_id=self.next_id("x"), targets=[attempt.id])))
        index = attempt.indices[j]
        if index in record.frames:
            return
        reason = msg.finish_reason
        if reason is not FinishReason.ABORT and too_stale(msg.versions, self.max_staleness):
            if self.stale_policy is StalePolicy.RECOMPUTE and not record.stream.aborted:
                self.metrics.count("stale_recomputed")
                self.dispatch(record, [index], now)
                return
            self.metrics.count("stale_aborted")
            reason = FinishReason.ABORT
        self._sink.deliver(record, msgspec.structs.replace(msg, request_id=record.request_id, sample_index=index,
                                                           n=record.n, finish_reason=reason), now)

    def _attempt_tokens(self, attempt: Attempt, msg: TokenDelta, now: float) -> None:
        if msg.sample_index not in attempt.left:  # a sample it runs for nobody (`sent_indices`)
            return
        index = attempt.indices[msg.sample_index]
        self._sink.forward_tokens(attempt.record, msgspec.structs.replace(msg, sample_index=index))

    def _attempt_refused(self, attempt: Attempt, msg: ErrorReply, now: float) -> None:
        record = attempt.record  # the replica refused the request itself: the client hears why
        for other in list(record.stream.attempts.values()):
            self._retire(other)
        self._sink.refused(record, msgspec.structs.replace(msg, request_id=record.request_id))

    # ---- introspection -------------------------------------------------------------------------

    def link_figures(self) -> list[tuple[str, ReplicaLink, int, dict[str, int]]]:
        """(name, link, load tokens, requests routed by reason) per replica."""
        return [(name, link, self.placement.load.get(name, 0), self.placement.routed_to(name))
                for name, link in self.links.items()]


# a replica's replies to an attempt, each to its one handler (a Result is not one: ignored)
_ATTEMPT_REPLIES: dict[type, Callable[[ReplicaSet, Attempt, Any, float], None]] = {
    SampleOutput: ReplicaSet._attempt_sample, TokenDelta: ReplicaSet._attempt_tokens,
    ErrorReply: ReplicaSet._attempt_refused,
}
