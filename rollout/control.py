"""ControlCalls: every control call of a client, written once, for every client.

Each call builds its wire request (`rollout.wire.messages`), hands it to the client's
`_control(msg, timeout, read)` and reads the `Result` it answers with `read`. What a client
adds is how a request travels and how its caller waits:

* `RolloutClient` sends it over ZMQ and blocks: a call returns the value;
* `AsyncRolloutClient` sends it over ZMQ, `InProcessClient` hands it to the engine service in
  this process (`rollout.service.engine_service`): a call returns an awaitable of the value;
* `rollout.RolloutEngine` hands it to the engine service in the caller's thread: the value.

So `client.pause()` and `await client.pause()` are one method, and a request is what the
server receives whichever client sent it. `ControlCalls` is a protocol with these as its
defaults: `rollout.RolloutBackend` and the HTTP front's `FrontClient` extend it, and SGLang's
weight-call names over them are `rollout.client.weights`. Requests are
built from the engine's own types (`PauseMode`, `SuspendPolicy`, `UpdatePolicy`), which the wire
carries as they are.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Protocol, Union

import weight_sync
from inference import PauseMode, SuspendPolicy, SuspendReport, UpdatePolicy
from rollout.wire import messages as wire
from weight_sync import DEFAULT_GROUP, AdapterSource, DiskSource, with_version

SOURCE_TYPES = typing.get_args(weight_sync.WeightSource)  # every kind a served engine can read
# what `update_weights` takes: a safetensors directory, a weight_sync source, or (in process) named tensors
WeightSource = Union[str, os.PathLike, Mapping[str, Any], Iterable[tuple[str, Any]], weight_sync.WeightSource]

Read = Callable[[wire.Result], Any]


def weight_source(source: WeightSource, version: Optional[int]) -> WeightSource:
    """What an update of a served engine reads: a path is a safetensors directory the server reads;
    else a weight_sync source (committing under `version`, None: its own)."""
    if isinstance(source, (str, os.PathLike)):
        source = DiskSource(path=str(Path(source).absolute()))
    elif not isinstance(source, SOURCE_TYPES):
        raise TypeError("a remote engine loads weights from a safetensors directory it can read (a path), or a "
                        f"weight_sync source (weight_sync.WeightSender sends those); got {type(source).__name__}")
    return with_version(source, version)


def suspend_report(stats: Optional[dict]) -> SuspendReport:
    fields = SuspendReport.__dataclass_fields__
    return SuspendReport(**{name: int((stats or {}).get(name, 0)) for name in fields})


def _nothing(result: wire.Result) -> None:
    return None


class ControlCalls(Protocol):
    """The control calls (see module docstring). A client supplies `_next_id(prefix)`, a fresh
    request id, and `_control(msg, timeout, read)`: `read(reply)`, or an awaitable of it, with
    `timeout` (None: the client's own) bounding the wait."""

    def _next_id(self, prefix: str = "c") -> str:
        raise NotImplementedError

    def _control(self, msg: wire.RequestMessage, timeout: Optional[float], read: Read) -> Any:
        raise NotImplementedError

    # ---- engine state ---------------------------------------------------------------------------

    def pause(self, mode: Union[PauseMode, str] = PauseMode.KEEP, *, timeout: Optional[float] = None) -> Any:
        """Stop generating: `abort` / `wait` (answered once drained) / `keep` / `retract` in-flight requests."""
        return self._control(wire.Pause(request_id=self._next_id(), mode=PauseMode(mode)), timeout, _nothing)

    def continue_(self, *, timeout: Optional[float] = None) -> Any:
        return self._control(wire.Continue(request_id=self._next_id()), timeout, _nothing)

    def suspend(self, policy: Optional[Union[SuspendPolicy, str]] = None, *, offload_weights: bool = False,
                tags: Optional[Sequence[str]] = None, discard_weights: bool = False,
                timeout: Optional[float] = None) -> Any:
        """Free the KV buffer (and the weights if asked), or the parts `tags` names; requests in flight
        per `policy` (None: the engine's configured one). The engine's `SuspendReport`."""
        msg = wire.Suspend(request_id=self._next_id(), policy=None if policy is None else SuspendPolicy(policy),
                           offload_weights=bool(offload_weights), tags=None if tags is None else list(tags),
                           discard_weights=bool(discard_weights))
        return self._control(msg, timeout, lambda r: suspend_report(r.stats))

    def resume(self, *, tags: Optional[Sequence[str]] = None, timeout: Optional[float] = None) -> Any:
        msg = wire.Resume(request_id=self._next_id(), tags=None if tags is None else list(tags))
        return self._control(msg, timeout, _nothing)

    def reset_prefix_cache(self, *, timeout: Optional[float] = None) -> Any:
        return self._control(wire.ResetPrefixCache(request_id=self._next_id()), timeout, _nothing)

    def is_sleeping(self, *, timeout: Optional[float] = None) -> Any:
        """Whether the engine is suspended (through a router: every replica that answered is)."""
        return self._control(wire.IsSleeping(request_id=self._next_id()), timeout, lambda r: bool(r.sleeping))

    def health(self, *, timeout: Optional[float] = None) -> Any:
        """A `HealthInfo`, answered without the engine: whether its loop went round within the deadline."""
        return self._control(wire.Health(request_id=self._next_id()), timeout, lambda r: r.health)

    def stats(self, *, timeout: Optional[float] = None) -> Any:
        """The server's `Stats` keys: `engine/*`, the headline keys, counters, `weight_sync/*`."""
        return self._control(wire.Stats(request_id=self._next_id()), timeout, lambda r: dict(r.stats or {}))

    def abort_requests(self, targets: list[str], *, timeout: Optional[float] = None) -> Any:
        """Finish the requests `targets` (this client's Generate ids) now; their samples still come."""
        return self._control(wire.Abort(request_id=self._next_id("a"), targets=list(targets)), timeout, _nothing)

    # ---- LoRA adapters --------------------------------------------------------------------------

    def load_lora(self, name: str, path: Union[str, os.PathLike], *, timeout: Optional[float] = None) -> Any:
        """Load the PEFT adapter in directory `path` (as the server reads it; sent as an absolute path)
        as `name`; again: its next version. A bad adapter is refused (INVALID_REQUEST) and the engine
        serves on. Its `LoraInfo`."""
        msg = wire.LoadLora(request_id=self._next_id(), lora_name=name, lora_path=str(Path(path).absolute()))
        return self._control(msg, timeout, lambda r: r.loras[0])

    def unload_lora(self, name: str, *, timeout: Optional[float] = None) -> Any:
        return self._control(wire.UnloadLora(request_id=self._next_id(), lora_name=name), timeout, _nothing)

    def list_loras(self, *, timeout: Optional[float] = None) -> Any:
        """The loaded adapters' `LoraInfo`s."""
        return self._control(wire.ListLoras(request_id=self._next_id()), timeout, lambda r: list(r.loras or []))

    # ---- weights (`weight_sync.WeightControl`: what a `WeightSender` calls) ----------------------

    def update_weights(self, source: WeightSource, version: Optional[int] = None, *,
                       policy: Optional[Union[UpdatePolicy, str]] = None, timeout: Optional[float] = None) -> Any:
        """Load the weights in the safetensors directory `source` (a path the server can read), or a
        weight_sync source; the policy version after it."""
        return self.update(weight_source(source, version), policy, timeout=timeout)

    def update(self, source: WeightSource, policy: Any = None, *, timeout: Optional[float] = None) -> Any:
        """One whole update from `source` (its version inside it); the policy version after it."""
        msg = wire.UpdateWeights(request_id=self._next_id(), source=source,
                                 policy=None if policy is None else UpdatePolicy(policy))
        return self._control(msg, timeout, lambda r: r.policy_version)

    def update_lora(self, source: AdapterSource, *, timeout: Optional[float] = None) -> Any:
        """An adapter-only sync (`weight_sync.lora_sync`, what `WeightSender.sync_lora` sends): the
        adapter's version once committed (behind a router: on every replica)."""
        return self._control(wire.SyncLora(request_id=self._next_id(), source=source), timeout,
                             lambda r: r.loras[0].version)

    def join_group(self, master_address: str, master_port: int, rank_offset: Optional[int], world_size: int,
                   group_name: str = DEFAULT_GROUP, backend: Optional[str] = None, *,
                   timeout_s: Optional[float] = None, timeout: Optional[float] = None) -> Any:
        """Join the trainer's weight-update group (it listens at master_address:master_port as
        rank 0); this replica's rank (behind a router: the fleet's reply)."""
        msg = wire.InitWeightsUpdateGroup(request_id=self._next_id(), master_address=master_address,
                                          master_port=int(master_port), world_size=int(world_size),
                                          rank_offset=rank_offset, group_name=group_name, backend=backend,
                                          timeout_s=timeout_s)
        return self._control(msg, timeout, lambda r: int((r.stats or {}).get("rank", -1)))

    def leave_group(self, group_name: str = DEFAULT_GROUP, *, timeout: Optional[float] = None) -> Any:
        msg = wire.DestroyWeightsUpdateGroup(request_id=self._next_id(), group_name=group_name)
        return self._control(msg, timeout, _nothing)

    def weight_version(self, *, timeout: Optional[float] = None) -> Any:
        return self._control(wire.GetWeightVersion(request_id=self._next_id()), timeout,
                             lambda r: int(r.policy_version))
