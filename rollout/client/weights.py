"""SGLang's names for the weight-sync calls of a remote engine.

`RolloutClient` has these. What a `WeightSender` calls is `weight_sync.WeightControl`, among the
client's control calls (`rollout.control`): `update(source, policy)` (the source whole, its
version inside its manifest), `join_group` / `leave_group`, `weight_version()`. An RL framework
written against SGLang's engine API finds its calls here, each a facade over those:

    client.init_weights_update_group(master_address, master_port, rank_offset, world_size,
                                     group_name="weight_update_group", backend=None)
    client.update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache=True,
                                           abort_all_requests=False, weight_version=None)
    client.update_weights_from_tensor(serialized_named_tensors, ...)   # our msgpack handle, never pickle
    client.update_weights_from_disk(model_path, ...)
    client.get_weight_version()                                         # "7"
    client.destroy_weights_update_group(group_name)

The field names follow SGLang 0.5's `io_struct.py` (`InitWeightsUpdateGroupReqInput`,
`UpdateWeightsFromDistributedReqInput`, `UpdateWeightsFromTensorReqInput`,
`UpdateWeightFromDiskReqInput`) and its `/get_weight_version` route. Where we differ, on purpose:

* one call is one atomic update (SGLang applies each call at once): a call that carries the whole
  model is begin / load / commit; a sequence of calls is one staged update that the last one
  commits (`finish`, keyword-only: None commits once the model is complete, False keeps it
  open, True commits now), as vLLM's begin / update / finish phases do;
* `weight_version` strings map to our integer versions (`"7"`, `"v7"`, `"step_7"` -> 7);
* `flush_cache` is accepted and always in effect: the prefix cache never serves blocks of
  another version; `abort_all_requests=True` is `policy="abort"` (keyword `policy` also takes
  `keep` / `recompute`); `load_format` other than None / "auto" is refused;
* `update_weights_from_tensor` takes `weight_sync.encode_tensor_payload`'s msgpack handle (or
  its base64 text); a pickled payload (SGLang's MultiprocessingSerializer) is refused;
* `backend` None picks gloo for a CPU engine and nccl for a GPU one; `rank_offset` None lets a
  replica claim its rank (one message, broadcast by a router to every replica).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Protocol, Union

from inference import Staging, UpdatePolicy
from rollout.control import ControlCalls
from rollout.wire import messages as wire
from weight_sync import (
    DEFAULT_GROUP,
    DiskSource,
    DistributedSource,
    Manifest,
    WeightSource,
    decode_tensor_payload,
    parse_weight_version,
    with_version,
)
from weight_sync.manifest import Layout


def update_policy(abort_all_requests: bool, policy: Optional[Union[UpdatePolicy, str]]) -> Optional[UpdatePolicy]:
    """SGLang's `abort_all_requests` and our `policy` as one `UpdatePolicy` (None: the engine's default)."""
    if abort_all_requests:
        if policy is not None and UpdatePolicy(policy) is not UpdatePolicy.ABORT:
            raise ValueError(f"abort_all_requests=True contradicts policy={policy!r}")
        return UpdatePolicy.ABORT
    return None if policy is None else UpdatePolicy(policy)


def _check_load_format(load_format: Optional[str]) -> None:
    if load_format not in (None, "auto"):
        raise ValueError(f"load_format {load_format!r} is not supported (None or 'auto')")


# ---- SGLang's arguments as weight_sync sources (what `WeightSyncCalls` and the HTTP routes send) ------


def sglang_update(source: WeightSource, weight_version: Any, abort_all_requests: bool, policy: Any
                  ) -> tuple[WeightSource, Optional[UpdatePolicy]]:
    """`source` under SGLang's `weight_version` ("7", "v7", ...), and the update's policy."""
    return with_version(source, parse_weight_version(weight_version)), update_policy(abort_all_requests, policy)


def distributed_source(names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str = DEFAULT_GROUP,
                       load_format: Optional[str] = None, *, layout: Optional[Layout] = None,
                       finish: Optional[bool] = None, staging: Optional[str] = None) -> DistributedSource:
    """Tensors broadcast over `group_name`: buckets by `layout`, else one broadcast per tensor."""
    _check_load_format(load_format)
    manifest = Manifest(names=list(names), dtypes=list(dtypes), shapes=[list(s) for s in shapes], layout=layout)
    return DistributedSource(manifest=manifest, group_name=group_name, finish=finish,
                             staging=None if staging is None else Staging(staging))


def tensor_source(serialized_named_tensors: list[Union[bytes, str]], load_format: Optional[str] = None
                  ) -> WeightSource:
    """One msgpack handle of buckets in shared memory on this host (one engine rank); never pickle.
    `load_format` "flattened_bucket" (SGLang's name for tensors packed flat in buckets) is what such
    a handle is, so it is taken as well (`weight_sync.tensor_payload` makes one)."""
    _check_load_format(None if load_format == "flattened_bucket" else load_format)
    if len(serialized_named_tensors) != 1:
        raise ValueError(f"serialized_named_tensors: one entry per engine rank, and this engine has one "
                         f"(got {len(serialized_named_tensors)})")
    return decode_tensor_payload(serialized_named_tensors[0])


def disk_source(model_path: Union[str, Path], load_format: Optional[str] = None) -> DiskSource:
    """A safetensors directory the engine can read."""
    _check_load_format(load_format)
    return DiskSource(path=str(Path(model_path).absolute()))


class WeightSyncCalls(ControlCalls, Protocol):
    """The control calls (`rollout.control`; `weight_sync.WeightControl`'s `update`,
    `join_group`, `leave_group`, `weight_version` among them) and SGLang's names over those, as
    defaults: every client's (blocking: their values; asyncio: awaitables of them). The HTTP front's
    SGLang and vLLM weight routes call these on its client."""

    # ---- SGLang's names -------------------------------------------------------------------------

    def _sglang_update(self, source: WeightSource, weight_version: Any, abort_all_requests: bool, policy: Any,
                       timeout: Optional[float]) -> Any:
        source, policy = sglang_update(source, weight_version, abort_all_requests, policy)
        return self.update(source, policy, timeout=timeout)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: Optional[int],
                                  world_size: int, group_name: str = DEFAULT_GROUP, backend: Optional[str] = None,
                                  *, timeout_s: Optional[float] = None, timeout: Optional[float] = None) -> Any:
        return self.join_group(master_address, master_port, rank_offset, world_size, group_name, backend,
                               timeout_s=timeout_s, timeout=timeout)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP, *,
                                     timeout: Optional[float] = None) -> Any:
        return self.leave_group(group_name, timeout=timeout)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = DEFAULT_GROUP, flush_cache: bool = True,
                                        abort_all_requests: bool = False, weight_version: Any = None,
                                        load_format: Optional[str] = None, *, layout: Optional[Layout] = None,
                                        finish: Optional[bool] = None, staging: Optional[str] = None,
                                        policy: Any = None, timeout: Optional[float] = None) -> Any:
        """Receive tensors broadcast over `group_name`: buckets by `layout` (weight_sync's
        protocol), else one broadcast per tensor (SGLang's); returns the policy version after it."""
        source = distributed_source(names, dtypes, shapes, group_name, load_format, layout=layout, finish=finish,
                                    staging=staging)
        return self._sglang_update(source, weight_version, abort_all_requests, policy, timeout)

    def update_weights_from_tensor(self, serialized_named_tensors: list[Union[bytes, str]],
                                   load_format: Optional[str] = None, flush_cache: bool = True,
                                   abort_all_requests: bool = False, weight_version: Any = None, *,
                                   policy: Any = None, timeout: Optional[float] = None) -> Any:
        """Copy buckets from shared memory on this host: one msgpack handle (one engine rank)."""
        source = tensor_source(serialized_named_tensors, load_format)
        return self._sglang_update(source, weight_version, abort_all_requests, policy, timeout)

    def update_weights_from_disk(self, model_path: Union[str, Path], load_format: Optional[str] = None,
                                 abort_all_requests: bool = False, weight_version: Any = None, *,
                                 policy: Any = None, timeout: Optional[float] = None) -> Any:
        """Load a safetensors directory the engine can read (checked against its manifest if it has one)."""
        source = disk_source(model_path, load_format)
        return self._sglang_update(source, weight_version, abort_all_requests, policy, timeout)

    def get_weight_version(self, *, timeout: Optional[float] = None) -> Any:
        """The policy version as SGLang's route gives it (a string, "7")."""
        return self._control(wire.GetWeightVersion(request_id=self._next_id()), timeout,
                             lambda r: str(int(r.policy_version)))
