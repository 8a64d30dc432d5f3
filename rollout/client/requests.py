"""The clients' control requests: one builder per message kind that carries more than its id
(`plain(kind)` builds the others), ids from the connection.

Both clients (`RolloutClient`, `AsyncRolloutClient`) and the weight-call facade build their
requests here, from the engine's own types (`PauseMode`, `SuspendPolicy`, `UpdatePolicy`), which
the wire carries as they are.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Optional, TypeVar, Union

import weight_sync
from inference import PauseMode, SuspendPolicy, UpdatePolicy
from rollout.backend import WeightSource
from rollout.client.connection import Connection
from rollout.wire import messages as wire
from weight_sync import DiskSource, with_version

Plain = TypeVar("Plain", wire.Continue, wire.Resume, wire.ResetPrefixCache, wire.Stats, wire.Health,
                wire.GetWeightVersion, wire.IsSleeping, wire.ListLoras)


SOURCE_TYPES = typing.get_args(weight_sync.WeightSource)  # every kind a served engine can read


def weight_source(source: WeightSource, version: Optional[int]) -> WeightSource:
    """What an update of a served engine reads: a path is a safetensors directory the server reads;
    else a weight_sync source (committing under `version`, None: its own)."""
    if isinstance(source, (str, os.PathLike)):
        source = DiskSource(path=str(Path(source).absolute()))
    elif not isinstance(source, SOURCE_TYPES):
        raise TypeError("a remote engine loads weights from a safetensors directory it can read (a path), or a "
                        f"weight_sync source (weight_sync.WeightSender sends those); got {type(source).__name__}")
    return with_version(source, version)


class Requests:
    """Builds each control request with a fresh id of `connection`'s session."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def _id(self, prefix: str = "c") -> str:
        return self.connection.next_id(prefix)

    def plain(self, kind: type[Plain]) -> Plain:
        """A request that carries nothing but its id (Continue, Resume, Stats, IsSleeping, ...)."""
        return kind(request_id=self._id())

    def load_lora(self, name: str, path: Union[str, os.PathLike]) -> wire.LoadLora:
        """A PEFT adapter directory the server can read (sent as an absolute path)."""
        return wire.LoadLora(request_id=self._id(), lora_name=name, lora_path=str(Path(path).absolute()))

    def unload_lora(self, name: str) -> wire.UnloadLora:
        return wire.UnloadLora(request_id=self._id(), lora_name=name)

    def pause(self, mode: Union[PauseMode, str]) -> wire.Pause:
        return wire.Pause(request_id=self._id(), mode=PauseMode(mode))

    def suspend(self, policy: Optional[Union[SuspendPolicy, str]], offload_weights: bool,
                tags: Optional[Sequence[str]] = None, discard_weights: bool = False) -> wire.Suspend:
        return wire.Suspend(request_id=self._id(), policy=SuspendPolicy(policy or SuspendPolicy.RECOMPUTE),
                            offload_weights=bool(offload_weights), tags=None if tags is None else list(tags),
                            discard_weights=bool(discard_weights))

    def resume(self, tags: Optional[Sequence[str]] = None) -> wire.Resume:
        return wire.Resume(request_id=self._id(), tags=None if tags is None else list(tags))

    def update_weights(self, source: WeightSource, version: Optional[int],
                       policy: Optional[Union[UpdatePolicy, str]]) -> wire.UpdateWeights:
        return wire.UpdateWeights(request_id=self._id(), source=weight_source(source, version),
                                  policy=None if policy is None else UpdatePolicy(policy))

    def abort(self, targets: list[str]) -> wire.Abort:
        return wire.Abort(request_id=self._id("a"), targets=targets)
