"""ServerCalls: a server's request handlers, one per message class: an `EngineService` call (the
server's `service`, `rollout.service.engine_service`) turned into its reply, or answered without
the engine.

Nothing here waits: each service call returns a `Future` whose done-callback puts a `CallReply`
into the endpoint's mailbox, and the socket thread sends the answer when it drains it. So a WAIT
pause (answered once the engine drained) and a weight update (answered at its commit) never hold
up the calls behind them. Order is the loop's: a control call posted after a Generate runs after
it (queued Generates are handed to the engine first, in one `submit_each`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

from inference import PendingAdmission
from rollout.wire.codec import ProtocolError
from rollout.wire.convert import loras_to_wire
from rollout.wire.kinds import ErrorCode
from rollout.wire.messages import (
    Abort,
    Continue,
    DestroyWeightsUpdateGroup,
    GetWeightVersion,
    Health,
    Heartbeat,
    InitWeightsUpdateGroup,
    IsSleeping,
    KvEvents,
    ListLoras,
    LoadLora,
    LoraInfo,
    Pause,
    RequestMessage,
    ResetPrefixCache,
    Result,
    Resume,
    Stats,
    Suspend,
    SyncLora,
    UnloadLora,
    UpdateWeights,
    kind_of,
)

# the calls that change the engine's state, counted when they succeed
COUNTED = {Pause: "pauses", Suspend: "suspends", Resume: "resumes", UpdateWeights: "weight_updates"}


@dataclass(slots=True)
class CallReply:
    """A posted call finished: `render(value)` is what the reply's `Result` carries beyond its
    version (`stats`, `sleeping`; empty: nothing)."""

    peer: Optional[bytes]
    msg: RequestMessage
    future: Future
    render: Callable[[Any], dict]


class ServerCalls:
    """The handlers of `RolloutServer` (a table by message class, `table()`); `server` is the
    owner: its engine, receiver, KV log, endpoint and the flush of queued Generates."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.engine = server.engine

    def table(self) -> dict[type, Callable[[bytes, Any, float], None]]:
        return {
            Abort: self.abort, Pause: self.pause, Continue: self.simple, Suspend: self.suspend, Resume: self.resume,
            ResetPrefixCache: self.simple, Stats: self.stats, UpdateWeights: self.update_weights,
            InitWeightsUpdateGroup: self.join_group, DestroyWeightsUpdateGroup: self.leave_group,
            Health: self.health, Heartbeat: self.heartbeat, GetWeightVersion: self.heartbeat,
            KvEvents: self.kv_events, IsSleeping: self.is_sleeping,
            LoadLora: self.load_lora, UnloadLora: self.unload_lora, ListLoras: self.list_loras,
            SyncLora: self.sync_lora,
        }

    # ---- answered without the engine -----------------------------------------------------------

    def _result(self, msg: RequestMessage, **fields: Any) -> Result:
        return Result(request_id=msg.request_id, request_kind=kind_of(type(msg)),
                      policy_version=self.engine.policy_version, **fields)

    def health(self, peer: bytes, msg: Health, now: float) -> None:
        self.server.endpoint.send(peer, self._result(msg, health=self.server.health()))

    def heartbeat(self, peer: bytes, msg: Any, now: float) -> None:
        self.server.endpoint.send(peer, self._result(msg))

    def kv_events(self, peer: bytes, msg: KvEvents, now: float) -> None:
        # NOTE: a hash takes at most 9 bytes of msgpack, an event's framing 3 more
        limit = (self.server.endpoint.config.max_frame_bytes - 512) // 12
        batch = self.server.kv_log.read(msg.since, msg.max_events, max_hashes=limit)
        self.server.endpoint.send(peer, self._result(msg, kv_events=batch))

    # ---- posted to the engine's loop -----------------------------------------------------------

    def _post(self, peer: Optional[bytes], msg: RequestMessage, call: Callable[[], Future],
              render: Callable[[Any], dict] = lambda value: {}) -> None:
        """`call()` (an `EngineService` method, or a post of the server's own) once the Generates read
        before `msg` were handed to the engine, so it runs after them."""
        self.server.flush_generates()
        self._answer(peer, msg, call(), render)

    def _answer(self, peer: Optional[bytes], msg: RequestMessage, future: Future,
                render: Callable[[Any], dict] = lambda value: {}) -> None:
        mailbox = self.server.endpoint.mailbox
        future.add_done_callback(lambda f: mailbox.put(CallReply(peer, msg, f, render)))

    def simple(self, peer: bytes, msg: Any, now: float) -> None:
        service = self.server.service
        call = {Continue: service.continue_, ResetPrefixCache: service.reset_prefix_cache}
        self._post(peer, msg, call[type(msg)])

    def abort(self, peer: Optional[bytes], msg: Abort, now: float, records: Optional[list] = None) -> None:
        if records is None:
            records = [r for r in map(self.server.endpoint.registry.get, msg.targets) if r is not None]
            if not records:
                raise ProtocolError(ErrorCode.NOT_FOUND, f"no request with id {msg.targets[0]!r}"
                                    + (f" (nor {len(msg.targets) - 1} more)" if len(msg.targets) > 1 else ""))

        def call() -> dict:  # NOTE: on the loop, after the Generates posted before it set their streams
            for r in records:
                if isinstance(r.stream, PendingAdmission):  # NOTE: its grammar still builds: aborted once admitted
                    r.stream.cancel()
            ids = [rid for r in records if r.stream is not None for rid in r.stream.request_ids]
            return {"aborted": self.engine.abort_many(ids)}

        self._post(peer, msg, lambda: self.engine.post(call), lambda value: {"stats": value})

    def pause(self, peer: bytes, msg: Pause, now: float) -> None:
        # NOTE: what was read before the pause is admitted first (WAIT lets it finish)
        self._post(peer, msg, lambda: self.server.service.pause(msg.mode))

    def suspend(self, peer: bytes, msg: Suspend, now: float) -> None:
        self._post(peer, msg, lambda: self.server.service.suspend(
            msg.policy, offload_weights=msg.offload_weights, tags=msg.tags, discard_weights=msg.discard_weights),
            lambda report: {"stats": dataclasses.asdict(report)})

    def resume(self, peer: bytes, msg: Resume, now: float) -> None:
        self._post(peer, msg, lambda: self.server.service.resume(msg.tags))

    def stats(self, peer: bytes, msg: Stats, now: float) -> None:
        self._post(peer, msg, self.server.service.figures,
                   lambda figures: {"stats": self.server.stats_snapshot(figures)})

    def is_sleeping(self, peer: bytes, msg: IsSleeping, now: float) -> None:
        self._post(peer, msg, self.server.service.is_sleeping, lambda asleep: {"sleeping": asleep})

    def load_lora(self, peer: bytes, msg: LoadLora, now: float) -> None:
        # NOTE: added on the loop after the Generates read before it
        self._post(peer, msg, lambda: self.server.service.load_lora(msg.lora_name, msg.lora_path),
                   lambda infos: {"loras": loras_to_wire(infos)})

    def unload_lora(self, peer: bytes, msg: UnloadLora, now: float) -> None:
        self._post(peer, msg, lambda: self.server.service.unload_lora(msg.lora_name))

    def list_loras(self, peer: bytes, msg: ListLoras, now: float) -> None:
        self._post(peer, msg, self.server.service.list_loras, lambda infos: {"loras": loras_to_wire(infos)})

    # ---- the receiver's worker -----------------------------------------------------------------

    def update_weights(self, peer: bytes, msg: UpdateWeights, now: float) -> None:
        self._post(peer, msg, lambda: self.server.service.update_weights(msg.source, msg.policy),
                   lambda o: {"stats": {"committed": int(o.committed), "bytes_received": o.bytes_received}})

    def sync_lora(self, peer: bytes, msg: SyncLora, now: float) -> None:
        # NOTE: on the receiver's worker, as a full update: the socket thread never waits on the bytes
        outcome = self.server.service.sync_lora(msg.source)
        self._answer(peer, msg, outcome, lambda o: {
            "loras": [LoraInfo(name=o.name, version=o.version, rank=o.rank)],
            "stats": {"committed": 1, "bytes_received": o.bytes_received}})

    def join_group(self, peer: bytes, msg: InitWeightsUpdateGroup, now: float) -> None:
        rank = self.server.service.join_group(msg.master_address, msg.master_port, msg.rank_offset, msg.world_size,
                                              msg.group_name, msg.backend, msg.timeout_s)
        self._answer(peer, msg, rank, lambda r: {"stats": {"rank": r}})

    def leave_group(self, peer: bytes, msg: DestroyWeightsUpdateGroup, now: float) -> None:
        left = self.server.service.leave_group(msg.group_name)
        self._answer(peer, msg, left, lambda d: {"stats": {"destroyed": int(d)}})
