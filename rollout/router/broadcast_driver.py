"""The router's control broadcast, driven from its `ReplicaSet` (a mixin over its links, attempts and
fleet state): a control request sent to every replica that is up (a weight group's broadcast: and to
those lagging), the fleet's state moved once all answered, replicas that failed it taken out, and
after a weight update the attempts started too many versions ago recomputed or aborted."""

from __future__ import annotations

import time
from typing import Any

from inference.config import StalePolicy
from rollout.router.broadcast import Fanout
from rollout.router.links import ReplicaLink, ReplicaState
from rollout.wire.codec import encode
from rollout.wire.kinds import Kind
from rollout.wire.messages import Abort, RequestMessage

KINDS = {cls: Kind(cls.__struct_config__.tag) for cls in RequestMessage.__args__}


class ControlBroadcast:
    """`ReplicaSet`'s control broadcast (module docstring); the state it reads and writes is the set's."""

    links: Any
    fleet: Any
    attempts: Any

    def broadcast(self, fan: Fanout, now: float) -> None:
        """Send `fan.msg` to every replica that is up (a weight group's broadcast: and to those
        `lagging`); `Sink.control_done` once all answered."""
        fan.broadcast = True
        if fan.msg.commits_version:
            self._updating += 1
            fan.on_done = self._update_done
        up = [link for link in self.links.values() if link.state is ReplicaState.UP]
        if fan.msg.collective:
            up += self.lagging(now)
        if fan.msg.ranked:
            up.sort(key=lambda link: link.name)
        for i, link in enumerate(up):
            self.send_part(link, fan, fan.msg.for_replica(i))
        if fan.done:
            self._fanout_done(fan, now)

    def lagging(self, now: float) -> list[ReplicaLink]:
        """Replicas out only because they lag: healthy, on another policy version than the fleet's,
        with no update the router could replay to them (`FleetState.sync_plan`: only a directory
        can be read again). What brings them back is the trainer's next in-memory update, so the
        weight group's broadcasts (`collective` requests) reach them too: they join the group with the
        others, a full sync (a delta's full manifest) moves them to the fleet's version, and their
        next health reply brings them up. They are never routed requests meanwhile."""
        fleet = self.fleet
        return [link for link in self.links.values()
                if link.state is ReplicaState.DOWN and link.looks_healthy(now) and fleet.version is not None
                and link.version != fleet.version and fleet.last_update is None]

    def _fanout_done(self, fan: Fanout, now: float) -> None:
        kind = KINDS[type(fan.msg)]
        if fan.broadcast and fan.msg.stateful and fan.succeeded:
            versions = [v for r in fan.succeeded if (v := fan.replies[r].policy_version) is not None]
            self.fleet.applied(fan.msg, max(versions) if fan.msg.commits_version and versions else None)
            for name in fan.failed:
                if name in self.links:
                    self.take_out(self.links[name], f"{kind.name} failed: {fan.replies[name].message}", now)
            for name in fan.succeeded:
                link = self.links.get(name)
                if link is not None and link.state is ReplicaState.DOWN and fan.msg.commits_version:
                    link.heard(now, fan.replies[name].policy_version)  # a lagging one, in step again:
                    link.retry_at = now  # NOTE: up at its next health reply (`_sync`), not after a back-off
                elif link is not None and link.version != self.fleet.version:
                    self.take_out(link, f"at policy version {link.version}, the fleet at {self.fleet.version}", now)
        if fan.on_done is not None:
            fan.on_done(fan)
        if fan.peer is not None:
            self._sink.control_done(fan)

    def _update_done(self, fan: Fanout) -> None:
        self._updating -= 1
        if fan.succeeded:
            self._sweep_stale(time.monotonic())

    def _sweep_stale(self, now: float) -> None:
        """After an update: attempts started too many versions ago are recomputed (or aborted)."""
        limit, version = self.max_staleness, self.fleet.version
        if limit is None or version is None:
            return
        for attempt in [a for a in self.attempts.values() if a.version < version - limit and not a.aborting]:
            self.links[attempt.replica].send(encode(Abort(request_id=self.next_id("x"), targets=[attempt.id])))
            if self.stale_policy is StalePolicy.ABORT:
                attempt.aborting = True
                self.metrics.count("stale_aborted", len(attempt.left))
                continue
            self.metrics.count("stale_recomputed", len(attempt.left))
            self._retire(attempt)
            self.dispatch(attempt.record, attempt.owed(), now)
