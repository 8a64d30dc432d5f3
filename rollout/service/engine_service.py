"""EngineService: one engine and its weight receiver behind every front, one method per request kind.

`handle(msg)` takes a wire request (`rollout.wire.messages`) and returns at once a `Future` of what
its `Result` carries beyond its id, kind and version (`stats`, `sleeping`, `loras`, `health`; empty:
nothing). The call is posted to the engine's loop (its one command queue, in order with every other
call, generations included) or run on the receiver's worker (weight transfers wait on their sender;
adapter directories are read on its LoRA reader). Nothing here waits, so a WAIT pause (resolved once
the engine drained) or a weight update (resolved at its commit) never holds up what a front does next.

The fronts are adapters over it: the ZMQ server (`rollout.server.dispatch`) sends each answer as
its reply, the in-process client (`rollout.client.in_process`) awaits it as a client reads a reply.
What they add is theirs alone: their error replies, metrics, timeouts, and what only they know
(aborting their own requests, their traffic in `Stats`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from inference import DynamicInferenceEngine, EngineState, PauseMode, UpdatePolicy
from rollout.service.metrics import _wire_values
from rollout.wire.convert import engine_figures, health_of, loras_to_wire
from rollout.wire.messages import (
    Continue,
    DestroyWeightsUpdateGroup,
    GetWeightVersion,
    Health,
    InitWeightsUpdateGroup,
    IsSleeping,
    ListLoras,
    LoadLora,
    LoraInfo,
    Pause,
    RequestMessage,
    ResetPrefixCache,
    Resume,
    Suspend,
    SyncLora,
    UnloadLora,
    UpdateWeights,
)
from weight_sync import WeightReceiver

# a loop quiet for longer is unhealthy: what every front uses unless told otherwise
HEALTH_DEADLINE_S = 10.0


def _no_fields(value: Any) -> dict:
    """A reply that carries nothing beyond its version."""
    return {}


class EngineService:
    """`engine` and its `receiver` (see module docstring); `health_deadline_s`: a loop quiet for
    longer is unhealthy."""

    def __init__(self, engine: DynamicInferenceEngine, receiver: WeightReceiver, health_deadline_s: float) -> None:
        self.engine = engine
        self.receiver = receiver
        self.health_deadline_s = health_deadline_s

    def handle(self, msg: RequestMessage) -> Future:
        """`msg` (of a class in `SERVICE_KINDS`) run: a `Future` of its `Result`'s fields."""
        return _METHODS[type(msg)](self, msg)

    def _post(self, fn: Callable[[], Any], render: Callable[[Any], dict] = _no_fields) -> Future:
        return _then(self.engine.post(fn), render)

    # ---- engine state: posted to the loop ---------------------------------------------------------

    def pause(self, msg: Pause) -> Future:
        """Resolved once the pause took effect (WAIT: once what was admitted finished)."""
        return _then(self.engine.post_pause(PauseMode(msg.mode)))

    def continue_(self, msg: Continue) -> Future:
        return self._post(self.engine.continue_)

    def suspend(self, msg: Suspend) -> Future:
        """The engine's `SuspendReport` as `stats`."""
        engine = self.engine
        return self._post(lambda: engine.suspend(msg.policy, offload_weights=bool(msg.offload_weights), tags=msg.tags,
                                                 discard_weights=bool(msg.discard_weights)),
                          lambda report: {"stats": _wire_values(dataclasses.asdict(report))})

    def resume(self, msg: Resume) -> Future:
        engine = self.engine
        return self._post(lambda: engine.resume(msg.tags))

    def reset_prefix_cache(self, msg: ResetPrefixCache) -> Future:
        return self._post(self.engine.reset_prefix_cache)

    def is_sleeping(self, msg: IsSleeping) -> Future:
        """Posted, so it answers after every call sent before it (a suspend) took effect."""
        engine = self.engine
        return self._post(lambda: engine.state is EngineState.SUSPENDED, lambda asleep: {"sleeping": asleep})

    def figures(self) -> Future:
        """A `Future` of the engine's stats and KV use (`rollout.wire.convert.engine_figures`), to
        which a front adds its own traffic for a `Stats` reply."""
        engine = self.engine
        return engine.post(lambda: engine_figures(engine))

    # ---- answered now, without the engine ---------------------------------------------------------

    def health(self, msg: Health) -> Future:
        """From the loop's last tick: never waits for the engine (a wedged loop must show)."""
        return _done({"health": health_of(self.engine, self.health_deadline_s)})

    def weight_version(self, msg: GetWeightVersion) -> Future:
        """Nothing beyond the version every `Result` carries."""
        return _done({})

    # ---- LoRA adapters ----------------------------------------------------------------------------

    def load_lora(self, msg: LoadLora) -> Future:
        """The loaded adapter as `loras` (one): the directory is read on the receiver's LoRA reader
        (never the loop: a FIFO or a slow disk stalls no step), where disk weight updates may read;
        the adapter is added on the loop."""
        engine, name = self.engine, msg.lora_name
        return _then(self.receiver.load_lora(name, msg.lora_path), lambda _: {
            "loras": loras_to_wire([i for i in engine.list_loras() if i.name == name])})

    def unload_lora(self, msg: UnloadLora) -> Future:
        engine = self.engine
        return self._post(lambda: engine.unload_lora(msg.lora_name))

    def list_loras(self, msg: ListLoras) -> Future:
        return self._post(self.engine.list_loras, lambda infos: {"loras": loras_to_wire(infos)})

    # ---- weights: the receiver's worker -----------------------------------------------------------

    def update_weights(self, msg: UpdateWeights) -> Future:
        """Resolved at the commit."""
        policy = None if msg.policy is None else UpdatePolicy(msg.policy)
        return _then(self.receiver.apply(msg.source, policy), lambda o: {
            "stats": {"committed": int(o.committed), "bytes_received": o.bytes_received}})

    def sync_lora(self, msg: SyncLora) -> Future:
        return _then(self.receiver.apply_lora(msg.source), lambda o: {
            "loras": [LoraInfo(name=o.name, version=o.version, rank=o.rank)],
            "stats": {"committed": 1, "bytes_received": o.bytes_received}})

    def join_group(self, msg: InitWeightsUpdateGroup) -> Future:
        """This replica's rank in the weight-update group, as `stats`."""
        rank = self.receiver.join_group(msg.master_address, int(msg.master_port), msg.rank_offset,
                                        int(msg.world_size), msg.group_name, msg.backend, msg.timeout_s)
        return _then(rank, lambda r: {"stats": {"rank": r}})

    def leave_group(self, msg: DestroyWeightsUpdateGroup) -> Future:
        return _then(self.receiver.leave_group(msg.group_name), lambda d: {"stats": {"destroyed": int(d)}})


# each request kind the service answers, to its one method
_METHODS: dict[type, Callable[[EngineService, Any], Future]] = {
    Pause: EngineService.pause, Continue: EngineService.continue_, Suspend: EngineService.suspend,
    Resume: EngineService.resume, ResetPrefixCache: EngineService.reset_prefix_cache,
    IsSleeping: EngineService.is_sleeping, Health: EngineService.health, GetWeightVersion: EngineService.weight_version,
    LoadLora: EngineService.load_lora, UnloadLora: EngineService.unload_lora, ListLoras: EngineService.list_loras,
    UpdateWeights: EngineService.update_weights, SyncLora: EngineService.sync_lora,
    InitWeightsUpdateGroup: EngineService.join_group, DestroyWeightsUpdateGroup: EngineService.leave_group,
}
SERVICE_KINDS = frozenset(_METHODS)


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _then(future: Future, render: Callable[[Any], Any] = _no_fields) -> Future:
    """A `Future` of `render(future's value)`, or of its error."""
    out: Future = Future()

    def settle(done: Future) -> None:
        error = done.exception()
        if error is not None:
            out.set_exception(error)
            return
        try:
            out.set_result(render(done.result()))
        except BaseException as exc:  # noqa: BLE001 (handed to the caller through the future)
            out.set_exception(exc)
    future.add_done_callback(settle)
    return out
