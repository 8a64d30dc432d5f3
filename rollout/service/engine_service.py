"""EngineService: one engine and its weight receiver behind every front, one method per request kind.

Every method returns at once: a `Future` of the call's value, posted to the engine's loop (its one
command queue, in order with every other call, generations included) or run on the receiver's
worker (weight transfers wait on their sender; adapter directories are read on its LoRA reader).
Nothing here waits, so a WAIT pause (resolved once the engine drained) or a weight update
(resolved at its commit) never holds up what a front does next.

The fronts are adapters over it: the ZMQ server's handlers (`rollout.server.dispatch`) turn each
future into a reply, the in-process client (`rollout.client.in_process`) awaits it. What they
add is theirs alone: the wire's replies and error codes, their metrics, their timeouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Optional

from inference import DynamicInferenceEngine, EngineState, PauseMode, SuspendPolicy, UpdatePolicy
from rollout.wire.convert import engine_figures, health_of
from rollout.wire.messages import HealthInfo
from weight_sync import DEFAULT_GROUP, WeightReceiver
from weight_sync.sources import AdapterSource, WeightSource


class EngineService:
    """`engine` and its `receiver` (see module docstring)."""

    def __init__(self, engine: DynamicInferenceEngine, receiver: WeightReceiver) -> None:
        self.engine = engine
        self.receiver = receiver

    # ---- engine state: posted to the loop ---------------------------------------------------------

    def pause(self, mode: PauseMode) -> Future:
        """Resolved once the pause took effect (WAIT: once what was admitted finished)."""
        return self.engine.post_pause(PauseMode(mode))

    def continue_(self) -> Future:
        return self.engine.post(self.engine.continue_)

    def suspend(self, policy: Optional[SuspendPolicy] = None, *, offload_weights: bool = False,
                tags: Optional[Sequence[Any]] = None, discard_weights: bool = False) -> Future:
        """A `Future` of the engine's `SuspendReport`."""
        engine = self.engine
        return engine.post(lambda: engine.suspend(policy, offload_weights=bool(offload_weights), tags=tags,
                                                  discard_weights=bool(discard_weights)))

    def resume(self, tags: Optional[Sequence[Any]] = None) -> Future:
        engine = self.engine
        return engine.post(lambda: engine.resume(tags))

    def reset_prefix_cache(self) -> Future:
        return self.engine.post(self.engine.reset_prefix_cache)

    def is_sleeping(self) -> Future:
        """Posted, so it answers after every call sent before it (a suspend) took effect."""
        engine = self.engine
        return engine.post(lambda: engine.state is EngineState.SUSPENDED)

    def figures(self) -> Future:
        """A `Future` of the engine's stats and KV use (`rollout.wire.convert.engine_figures`)."""
        engine = self.engine
        return engine.post(lambda: engine_figures(engine))

    def health(self, deadline_s: float) -> HealthInfo:
        """From the loop's last tick, read now: never waits for the engine (a wedged loop must show)."""
        return health_of(self.engine, deadline_s)

    # ---- LoRA adapters ----------------------------------------------------------------------------

    def load_lora(self, name: str, path: str) -> Future:
        """A `Future` of the loaded adapter's `AdapterInfo`s (one): the directory is read on the
        receiver's LoRA reader (never the loop: a FIFO or a slow disk stalls no step), where disk
        weight updates may read; the adapter is added on the loop."""
        loaded: Future = Future()
        engine = self.engine

        def listed(done: Future) -> None:
            if done.exception() is not None:
                loaded.set_exception(done.exception())
                return
            loaded.set_result([i for i in engine.list_loras() if i.name == name])
        self.receiver.load_lora(name, path).add_done_callback(listed)
        return loaded

    def unload_lora(self, name: str) -> Future:
        engine = self.engine
        return engine.post(lambda: engine.unload_lora(name))

    def list_loras(self) -> Future:
        """A `Future` of the loaded adapters' `AdapterInfo`s."""
        return self.engine.post(self.engine.list_loras)

    # ---- weights: the receiver's worker -----------------------------------------------------------

    def update_weights(self, source: WeightSource, policy: Optional[UpdatePolicy] = None) -> Future:
        """A `Future` of the receiver's `UpdateOutcome` (resolved at the commit)."""
        return self.receiver.apply(source, None if policy is None else UpdatePolicy(policy))

    def sync_lora(self, source: AdapterSource) -> Future:
        return self.receiver.apply_lora(source)

    def join_group(self, master_address: str, master_port: int, rank_offset: Optional[int], world_size: int,
                   group_name: str = DEFAULT_GROUP, backend: Optional[Any] = None,
                   timeout_s: Optional[float] = None) -> Future:
        """A `Future` of this replica's rank in the weight-update group."""
        return self.receiver.join_group(master_address, int(master_port), rank_offset, int(world_size), group_name,
                                        backend, timeout_s)

    def leave_group(self, group_name: str = DEFAULT_GROUP) -> Future:
        return self.receiver.leave_group(group_name)

