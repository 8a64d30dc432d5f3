"""Control broadcast: one client's control request sent to every replica, answered once.

`Fanout` collects the replies of the replicas a request went to; it is done when each has
answered or was taken out (a replica that dies mid-broadcast does not hold the answer up). Its
`outcome()` is one reply: the common `Result` (policy version of the fleet; suspend reports and
abort counts summed; asleep if every replica that answered is), or, if every replica refused,
the first refusal (an adapter sync: if any replica refused it). Replicas that refused while
others succeeded are named in `failed`; the router takes them out of rotation and brings them
in line later.

`FleetState` is what every replica should be in: policy version, paused (and how), suspended,
and the last weight update, replayed to a replica that comes back (or joins) on an older
version. The broadcast is generic over message kinds: it copies the client's message for each
replica (a fresh request id) and never looks inside beyond `Pause.mode` and `UpdateWeights`; a
weight transport that cannot be replayed to one replica later (a collective broadcast) leaves a
lagging replica out until the trainer's next in-memory update, which reaches it too
(`ReplicaSet.lagging`).

`merge_stats` turns the replicas' `Stats` into one engine-level view for the router's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import msgspec

from inference.config import PauseMode
from inference.core.states import EngineState, MemoryTag, memory_parts
from rollout.wire.kinds import ErrorCode, Kind
from rollout.wire.messages import (
    Continue,
    ErrorReply,
    Pause,
    RequestMessage,
    Result,
    Resume,
    StatValue,
    Suspend,
    UpdateWeights,
)

logger = logging.getLogger(__name__)

Reply = Union[Result, ErrorReply]
# NOTE: an adapter sync's answer is a refusal if any replica refused it: a trainer told it committed
# would go on while that replica serves requests naming the adapter on its previous version


@dataclass(eq=False, slots=True)
class Fanout:
    """One control request (`msg`, from `peer`; None: the router's own) across replicas."""

    peer: Optional[bytes]
    msg: RequestMessage
    parts: dict[str, str] = field(default_factory=dict)  # replica name -> the id sent to it
    replies: dict[str, Reply] = field(default_factory=dict)
    absent: set[str] = field(default_factory=set)  # taken out before answering
    on_done: Optional[Callable[[Fanout], None]] = None  # called once done, before the client's reply
    broadcast: bool = False  # a control request for the whole fleet (not a sync step, not an abort)

    def add(self, replica: str, request_id: str) -> None:
        self.parts[replica] = request_id

    def on_reply(self, replica: str, reply: Reply) -> None:
        if replica in self.parts and replica not in self.absent:
            self.replies[replica] = reply

    def drop(self, replica: str) -> None:
        if replica in self.parts and replica not in self.replies:
            self.absent.add(replica)

    @property
    def done(self) -> bool:
        return len(self.replies) + len(self.absent) >= len(self.parts)

    @property
    def succeeded(self) -> list[str]:
        return [r for r, reply in self.replies.items() if isinstance(reply, Result)]

    @property
    def failed(self) -> list[str]:
        return [r for r, reply in self.replies.items() if isinstance(reply, ErrorReply)]

    def outcome(self, request_kind: Kind, fleet_version: Optional[int]) -> Reply:
        """The one reply to the client (its request id; see module docstring)."""
        rid = self.msg.request_id
        ok = [self.replies[r] for r in self.succeeded]
        if not ok or (self.msg.all_or_refused and self.failed):
            errors = [self.replies[r] for r in self.failed]
            if errors:
                first = errors[0]
                names = ", ".join(self.failed)
                return ErrorReply(code=first.code, message=f"{first.message} (replicas {names})", request_id=rid,
                                  context_error=first.context_error)
            return ErrorReply(code=ErrorCode.ENGINE_STATE, request_id=rid,
                              message=f"{request_kind.name}: no replica is up to apply it")
        stats = sum_stats([r.stats for r in ok if r.stats]) if any(r.stats for r in ok) else None
        asleep = [r.sleeping for r in ok if r.sleeping is not None]
        # NOTE: every replica loads the same adapters: the first answer lists them for the fleet
        loras = next((r.loras for r in ok if r.loras is not None), None)
        return Result(request_id=rid, request_kind=request_kind, policy_version=fleet_version, stats=stats,
                      sleeping=all(asleep) if asleep else None, loras=loras)


def sum_stats(dicts: list[dict[str, StatValue]]) -> dict[str, StatValue]:
    """Numbers summed key by key (a suspend's bytes, an abort's count); other values: the first's."""
    out: dict[str, StatValue] = {}
    for d in dicts:
        for key, value in d.items():
            have = out.get(key)
            if isinstance(value, (int, float)) and isinstance(have, (int, float)):
                out[key] = have + value
            elif have is None:
                out[key] = value
    return out


_MEANS = ("rate", "utilization", "fraction")


def merge_stats(replies: list[dict[str, StatValue]]) -> dict[str, StatValue]:
    """The replicas' engine figures (`engine/...` keys of their Stats, prefix dropped) as one:
    counts and sizes summed, rates and utilizations averaged, a text kept if all agree."""
    engines = [{k[len("engine/"):]: v for k, v in r.items() if k.startswith("engine/")} for r in replies]
    keys = dict.fromkeys(k for e in engines for k in e)
    out: dict[str, StatValue] = {}
    for key in keys:
        values = [e[key] for e in engines if key in e]
        if all(isinstance(v, (int, float)) for v in values):
            total = sum(values)
            # NOTE: by whole words: "generated_tokens" holds "rate" but is a count
            out[key] = total / len(values) if set(key.split("_")) & set(_MEANS) else total
        else:
            out[key] = values[0] if len(set(map(str, values))) == 1 else "mixed"
    return out


def asleep_parts(msg: Suspend) -> set[MemoryTag]:
    """The parts a `Suspend` puts to sleep (the engine's own reading of it)."""
    return memory_parts(msg.tags, msg.offload_weights or msg.discard_weights)


@dataclass(slots=True)
class FleetState:
    """What every replica should be in (see module docstring); None version: no replica seen yet."""

    version: Optional[int] = None
    paused: Optional[PauseMode] = None
    suspended: Optional[Suspend] = None
    last_update: Optional[UpdateWeights] = None

    @property
    def engine_state(self) -> EngineState:
        return EngineState.SUSPENDED if self.suspended else EngineState.PAUSED if self.paused else EngineState.RUNNING

    def applied(self, msg: RequestMessage, version: Optional[int]) -> None:
        """A broadcast of `msg` succeeded (on at least one replica), the fleet now at `version`."""
        change = _STATE_CHANGES.get(type(msg))
        if change is not None:
            change(self, msg)
        if version is not None:
            self.version = version

    def _paused(self, msg: Pause) -> None:
        self.paused = msg.mode

    def _continued(self, msg: Continue) -> None:
        self.paused = None

    def _suspended(self, msg: Suspend) -> None:
        if self.suspended is None:
            self.suspended = msg
            return
        parts = sorted(asleep_parts(self.suspended) | asleep_parts(msg))  # NOTE: each part sleeps once
        self.suspended = msgspec.structs.replace(self.suspended, tags=parts,
                                                 discard_weights=self.suspended.discard_weights or msg.discard_weights)

    def _resumed(self, msg: Resume) -> None:
        if self.suspended is None or msg.tags is None:
            self.suspended = None
            return
        left = sorted(asleep_parts(self.suspended) - set(msg.tags))
        self.suspended = msgspec.structs.replace(self.suspended, tags=left) if left else None

    def _updated(self, msg: UpdateWeights) -> None:
        # NOTE: only a replayable source (a directory) can be read again by one replica later: a
        # broadcast over a weight-update group or a shared-memory segment is gone once the trainer moved on
        self.last_update = msg if msg.source.replayable else None

    def sync_plan(self, version: Optional[int], engine_state: Optional[EngineState | str],
                  next_id: Any) -> Optional[list]:
        """The messages that bring a replica at `version` in `engine_state` in line with the
        fleet, in order (empty: it is); None if it cannot be (no update known to replay)."""
        state: Optional[EngineState] = EngineState(engine_state or EngineState.RUNNING)  # NOTE: a name is taken too
        stale = self.version is not None and version != self.version
        if stale and self.last_update is None:
            return None
        if state is EngineState.SUSPENDED and self.suspended is not None and not stale:
            return []
        plan: list[RequestMessage] = []
        if state is EngineState.SUSPENDED:
            plan.append(Resume(request_id=next_id()))
            state = None  # NOTE: unknown: resume restores the replica's own state from before its suspend
        if stale:
            update = self.last_update
            source = msgspec.structs.replace(update.source, version=self.version)
            plan.append(UpdateWeights(request_id=next_id(), source=source, policy=update.policy))
        if self.paused is not None and state is not EngineState.PAUSED:
            # NOTE: nothing of the router's runs there: KEEP pauses it as WAIT would, without a drain
            mode = PauseMode.KEEP if self.paused is PauseMode.WAIT else self.paused
            plan.append(Pause(request_id=next_id(), mode=mode))
        elif self.paused is None and state is not EngineState.RUNNING:
            plan.append(Continue(request_id=next_id()))
        if self.suspended is not None:
            plan.append(Suspend(request_id=next_id(), policy=self.suspended.policy,
                                offload_weights=self.suspended.offload_weights, tags=self.suspended.tags,
                                discard_weights=self.suspended.discard_weights))
        return plan


# the broadcasts that change what every replica should be in (the others leave it as it is)
_STATE_CHANGES: dict[type, Callable[[FleetState, Any], None]] = {
    Pause: FleetState._paused, Continue: FleetState._continued, Suspend: FleetState._suspended,
    Resume: FleetState._resumed, UpdateWeights: FleetState._updated,
}
