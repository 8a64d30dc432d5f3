"""`DynamicInferenceEngine`'s weight calls: binding a trainer's parameters, updates whole or staged
bucket by bucket (a mixin over the engine's `core` and `calls`: each call runs on the engine's loop,
or at once under its lock)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import torch

from inference.config import UpdatePolicy
from inference.weights.adapters import WeightAdapter
from inference.weights.manager import NamedTensors
from inference.weights.staging import OpenUpdate, Staging


class EngineWeightCalls:
    """The weight calls of `DynamicInferenceEngine` (module docstring)."""

    core: Any  # the EngineCore
    calls: Any  # its CoreCalls

    def bind_trainer_model(self, module: Any, adapter: Optional[WeightAdapter] = None) -> Any:
        """Alias the trainer's parameters (an HF `*ForCausalLM`, or another layout through its
        `adapter`: megatron-core's is `weight_sync.MEGATRON_ADAPTER`); returns the bind report.
        Call `on_weights_updated()` after each optimizer step."""
        return self.calls.run(self.core.bind_trainer_model, module, adapter)

    def on_weights_updated(self, policy: Optional[UpdatePolicy] = None) -> int:
        """The aliased weights changed in place: version + 1, prefix cache reset; no bytes move."""
        return self.calls.run(self.core.on_weights_updated, policy)

    def update_weights(self, named_tensors: NamedTensors, version: Optional[int] = None, *,
                       policy: Optional[UpdatePolicy] = None, partial: bool = False,
                       adapter: Optional[WeightAdapter] = None) -> int:
        """Copy weights in (HF names, or another layout's through its `adapter`), committed under a
        new version (returned). Names, shapes and dtypes are all checked first: on a typed error
        nothing changed."""
        return self.calls.run(self.core.update_weights, named_tensors, version, policy=policy, partial=partial,
                          adapter=adapter)

    def begin_update(self, version: Optional[int] = None, staging: Staging = Staging.DOUBLE, *,
                     partial: bool = False, retain_staging: bool = False, origin: str = "",
                     held: bool = False) -> None:
        """Open a staged weight update: `double` keeps serving the old weights until commit;
        `in_place` writes into the live ones and refuses to generate until a complete commit.
        `retain_staging` (double): the replaced weights become the next update's buffers (no
        allocation per update; a second copy of the weights is held until `suspend`). `origin` and
        `held` are for whoever feeds it across calls to read back (`open_update`)."""
        self.calls.run(self.core.begin_update, version, staging, partial=partial, retain_staging=retain_staging,
                       origin=origin, held=held)

    def open_update(self) -> Optional[OpenUpdate]:
        """The open staged update, as its feeder sees it (None: none is open): the one record of it.
        Read now, not on the loop (a feeder sending one tensor a call would otherwise wait a step per
        call): the record is replaced by begin / commit / abort, its fields never written."""
        return self.core.weights.open_update()

    def update_missing(self) -> list[str]:
        """The tensors a complete open update still lacks (empty: it can commit; a partial one lacks none).
        Read now, as `open_update`: for the update's feeder, between its own loads (which return once done)."""
        return self.core.weights.missing_from_update()

    def load_weights(self, named_tensors: NamedTensors, adapter: Optional[WeightAdapter] = None) -> int:
        """One bucket of the open update (checked before it is written; another layout's names
        through its `adapter`); names loaded so far."""
        return self.calls.run(self.core.load_weights, named_tensors, adapter)

    def staging_buffers(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The open double-staged update's buffers by name, for a transport to write into
        directly; `load_weights` of these very tensors then adopts them without a copy."""
        return self.calls.run(self.core.staging_buffers, names)

    def commit_update(self, policy: Optional[UpdatePolicy] = None) -> int:
        """Make the loaded weights live; version changes and the prefix cache resets, once."""
        return self.calls.run(self.core.commit_update, policy)

    def abort_update(self) -> None:
        """Drop the open update (see `begin_update` for what each staging leaves behind)."""
        self.calls.run(self.core.abort_update)
