"""ServerCalls: a server's request handlers, one per message class, each an engine call posted to
the engine's loop (its one command queue) or answered without the engine.

Nothing here waits: an engine call is `engine.post(...)`, a weight call the receiver's
`apply` / `join_group` / `leave_group`; each returns a `Future` whose done-callback puts a `CallReply`
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

from inference import EngineState, PendingAdmission
from rollout.wire.codec import ProtocolError
from rollout.wire.convert import engine_figures, loras_to_wire
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

    def _post(self, peer: Optional[bytes], msg: RequestMessage, call: Callable[[], Any],
              render: Callable[[Any], dict] = lambda value: {}) -> None:
        self.server.flush_generates()
        self._answer(peer, msg, self.engine.post(call), render)

    def _answer(self, peer: Optional[bytes], msg: RequestMessage, future: Future,
                render: Callable[[Any], dict] = lambda value: {}) -> None:
        mailbox = self.server.endpoint.mailbox
        future.add_done_callback(lambda f: mailbox.put(CallReply(peer, msg, f, render)))

    def simple(self, peer: bytes, msg: Any, now: float) -> None:
        engine = self.engine
        call = {Continue: engine.continue_, ResetPrefixCache: engine.reset_prefix_cache}
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

        self._post(peer, msg, call, lambda value: {"stats": value})

    def pause(self, peer: bytes, msg: Pause, now: float) -> None:
        self.server.flush_generates()  # NOTE: what was read before the pause is admitted (WAIT lets it finish)
        self._answer(peer, msg, self.engine.post_pause(msg.mode))

    def suspend(self, peer: bytes, msg: Suspend, now: float) -> None:
        engine = self.engine
        self._post(peer, msg, lambda: engine.suspend(msg.policy, offload_weights=msg.offload_weights, tags=msg.tags,
                                                     discard_weights=msg.discard_weights),
                   lambda report: {"stats": dataclasses.asdict(report)})

    def resume(self, peer: bytes, msg: Resume, now: float) -> None:
        engine = self.engine
        self._post(peer, msg, lambda: engine.resume(msg.tags))

    def stats(self, peer: bytes, msg: Stats, now: float) -> None:
        engine = self.engine
        self._post(peer, msg, lambda: engine_figures(engine),
                   lambda figures: {"stats": self.server.stats_snapshot(figures)})

    def is_sleeping(self, peer: bytes, msg: IsSleeping, now: float) -> None:
        # NOTE: posted, so it answers after every call this client sent before it (a suspend) took effect
        engine = self.engine
        self._post(peer, msg, lambda: engine.state is EngineState.SUSPENDED, lambda asleep: {"sleeping": asleep})

    def load_lora(self, peer: bytes, msg: LoadLora, now: float) -> None:
        # NOTE: read on the receiver's LoRA reader (never the loop: a FIFO or a slow disk stalls no step),
        # where disk weight updates may read (--weights-root); added on the loop after the Generates before it
        self.server.flush_generates()
        ref = self.server.receiver.load_lora(msg.lora_name, msg.lora_path)
        loaded: Future = Future()

        def listed(done: Future) -> None:
            if done.exception() is not None:
                loaded.set_exception(done.exception())
                return
            infos = self.engine.list_loras()
            loaded.set_result([i for i in infos if i.name == msg.lora_name])
        ref.add_done_callback(listed)
        self._answer(peer, msg, loaded, lambda infos: {"loras": loras_to_wire(infos)})

    def unload_lora(self, peer: bytes, msg: UnloadLora, now: float) -> None:
        engine = self.engine
        self._post(peer, msg, lambda: engine.unload_lora(msg.lora_name))

    def list_loras(self, peer: bytes, msg: ListLoras, now: float) -> None:
        engine = self.engine
        self._post(peer, msg, engine.list_loras, lambda infos: {"loras": loras_to_wire(infos)})

    # ---- the receiver's worker -----------------------------------------------------------------

    def update_weights(self, peer: bytes, msg: UpdateWeights, now: float) -> None:
        self.server.flush_generates()
        outcome = self.server.receiver.apply(msg.source, msg.policy)
        self._answer(peer, msg, outcome, lambda o: {"stats": {"committed": int(o.committed),
                                                                  "bytes_received": o.bytes_received}})

    def sync_lora(self, peer: bytes, msg: SyncLora, now: float) -> None:
        # NOTE: on the receiver's worker, as a full update: the socket thread never waits on the bytes
        outcome = self.server.receiver.apply_lora(msg.source)
        self._answer(peer, msg, outcome, lambda o: {
            "loras": [LoraInfo(name=o.name, version=o.version, rank=o.rank)],
            "stats": {"committed": 1, "bytes_received": o.bytes_received}})

    def join_group(self, peer: bytes, msg: InitWeightsUpdateGroup, now: float) -> None:
        rank = self.server.receiver.join_group(msg.master_address, msg.master_port, msg.rank_offset, msg.world_size,
                                               msg.group_name, msg.backend, msg.timeout_s)
        self._answer(peer, msg, rank, lambda r: {"stats": {"rank": r}})

    def leave_group(self, peer: bytes, msg: DestroyWeightsUpdateGroup, now: float) -> None:
        left = self.server.receiver.leave_group(msg.group_name)
        self._answer(peer, msg, left, lambda d: {"stats": {"destroyed": int(d)}})
