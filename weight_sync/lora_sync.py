"""Adapter-only weight sync: a trainer's LoRA adapter (its A and B tensors, nothing of the base
model) moved into every replica as the next version of a named adapter, both ends.

    sender = WeightSender([RolloutClient(router)], Transport.SHM, replicas=2)
    version = sender.sync_lora("policy", peft_model)     # returns once every replica committed it

The bytes travel exactly as a full sync's do, over the sender's transport (`gloo` / `nccl`
broadcast, `shm` segment; `transports.bucket_broadcast`, `transports.shared_memory`): a manifest of
the adapter's tensors with its bucket checksums, sent first in an `AdapterSource` (the adapter's
name and config: rank, alpha, rsLoRA, target modules), then the buckets; the bytes moved are the
adapter's. A replica checks the manifest's names and shapes against its model with the engine's
own adapter checks before a byte arrives (a bad shape or an unknown target refuses the whole
update then: over a group, every rank stops in step), receives the buckets into fresh host memory
(a checksum that does not match refuses it whole, on every replica of the group), builds the
adapter and only then makes it the current version in its LoRA registry. The registry's rules hold
(`inference.lora.registry`): requests in flight finish on the version they were pinned to, at
most `max_staleness + 1` versions are resident, the oldest freed when its last request ends. A
refused update changes nothing: the previous version serves on.

The version is the trainer's (`version`) or, None, each replica's next. A registry that refuses the
new version (too many versions pinned) refuses after the bytes moved, on that replica alone.
Disk needs nothing of this: `LoadLora` of a PEFT directory is the same update from a file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from inference.errors import LoRALoadError, LoRAShapeError, LoRATargetError
from inference.lora.adapter import check_peft_config
from weight_sync.buckets import as_bytes
from weight_sync.manifest import Manifest
from weight_sync.sources import LORA_KEY, MAX_LORA_NAME, AdapterSource, DistributedSource, SharedMemorySource
from weight_sync.transports import Transport
from weight_sync.transports.bucket_broadcast import receive_buckets
from weight_sync.transports.distributed import GroupError
from weight_sync.transports.shared_memory import cuda_ipc_buckets
from weight_sync.transports.shm import SegmentPlan, read_segment
from weight_sync.transports.table import BY_TRANSPORT

ADAPTER_TRANSPORTS = (Transport.GLOO, Transport.NCCL, Transport.SHM)  # disk: `LoadLora` of a PEFT directory
AdapterTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    """What a replica needs beside the tensors to compute the adapter as PEFT does."""

    rank: int
    alpha: float
    rslora: bool
    target_modules: tuple[str, ...]  # projection names, e.g. ("q_proj", "v_proj")


@dataclass(frozen=True, slots=True)
class AdapterOutcome:
    """A replica's committed adapter sync: the adapter's name, the version it serves now, its rank,
    and the bytes this update received."""

    name: str
    version: int
    rank: int
    bytes_received: int


# ---- the trainer's side --------------------------------------------------------------------------


def peft_adapter(peft_model: Any, adapter_name: str = "default") -> tuple[list[tuple[str, torch.Tensor]],
                                                                            AdapterConfig]:
    """A live PEFT model's adapter `adapter_name`: its LoRA tensors under PEFT's saved names
    (`base_model.model.<module>.lora_{A,B}.weight`, detached, as they are now) and its config,
    refused (typed, as a replica would) if the engine does not compute what it describes."""
    from peft.tuners.lora import LoraLayer  # NOTE: only a PEFT trainer needs peft

    config = getattr(peft_model, "peft_config", {}).get(adapter_name)
    if config is None:
        raise LoRALoadError(f"{type(peft_model).__name__} has no PEFT adapter {adapter_name!r}")
    check_peft_config(config, f"{adapter_name} (live)")
    if getattr(config, "alpha_pattern", None):  # NOTE: the source carries one alpha; a module's own would be lost
        raise LoRATargetError(f"PEFT adapter {adapter_name!r}: alpha_pattern gives modules their own alpha, which a "
                              "sync does not carry; load it from its directory or with load_lora_from_peft")
    # NOTE: one walk of the modules: peft's get_peft_model_state_dict walks the whole state dict
    # several times (~0.1-0.2 s for SmolLM2, as long as the shm transfer of its rank-16 adapter)
    named = []
    for path, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if adapter_name in getattr(module, "lora_embedding_A", {}):
            raise LoRATargetError(f"PEFT adapter {adapter_name!r} adapts embedding {path}: not served")
        if adapter_name in module.lora_A:
            named.append((f"{path}.lora_A.weight", module.lora_A[adapter_name].weight.detach()))
            named.append((f"{path}.lora_B.weight", module.lora_B[adapter_name].weight.detach()))
    return named, adapter_config(named, alpha=float(config.lora_alpha), rslora=bool(config.use_rslora))


def adapter_config(named: list[tuple[str, torch.Tensor]], *, alpha: float, rslora: bool = False) -> AdapterConfig:
    """The config of PEFT-named adapter tensors: their largest rank and the projections they adapt."""
    modules, rank = set(), 0
    for name, t in named:
        m = LORA_KEY.match(name)
        if m is None:
            raise ValueError(f"{name!r} is not a LoRA A/B weight (PEFT's `<module>.lora_A.weight`)")
        modules.add(m["module"].rsplit(".", 1)[-1])
        if name.endswith(".lora_A.weight"):
            rank = max(rank, int(t.shape[0]))
    if not named:
        raise ValueError("an adapter sync needs at least one LoRA tensor")
    return AdapterConfig(rank, alpha, rslora, tuple(sorted(modules)))


def send_adapter(sender: Any, name: str, named: list[tuple[str, torch.Tensor]], config: AdapterConfig,
                 version: Optional[int]) -> tuple[int, int]:
    """Move one adapter's tensors through `sender`'s transport to every target (`update_lora`);
    (the version the replicas committed, the bytes moved), or `SyncError`."""
    if sender.transport not in ADAPTER_TRANSPORTS:
        raise ValueError(f"an adapter sync rides {[t.value for t in ADAPTER_TRANSPORTS]}; over disk, save the "
                         "adapter with PEFT's save_pretrained and LoadLora its directory")
    # NOTE: the wire's bounds, checked here: a source a replica cannot decode would leave the group's
    # other ranks waiting for it until the timeout
    if not 0 < len(name) <= MAX_LORA_NAME or not 1 <= config.rank <= 2**16 or not config.alpha > 0:
        raise ValueError(f"adapter {name!r}: a name of 1..{MAX_LORA_NAME} characters, a rank in 1..65536 and an "
                         f"alpha > 0 (got rank {config.rank}, alpha {config.alpha})")
    answers: list[int] = []

    def tell(target: Any, payload: Union[DistributedSource, SharedMemorySource]) -> int:
        source = AdapterSource(name=name, rank=config.rank, alpha=config.alpha, rslora=config.rslora,
                               target_modules=list(config.target_modules), payload=payload)
        committed = int(target.update_lora(source))
        answers.append(committed)  # NOTE: list.append is atomic: the sender's threads share it
        return committed

    what = f"adapter {name!r} sync" + ("" if version is None else f" to version {version}")
    moved = BY_TRANSPORT[sender.transport].send(sender, named, version, None, tell=tell, what=what)
    return max(answers), moved


# ---- a replica's side ----------------------------------------------------------------------------


def check_adapter(engine: Any, source: AdapterSource) -> None:
    """Refuse, before a byte arrives, an adapter this engine cannot serve: the engine's own checks
    on the manifest's names and shapes, and the trainer's config against them."""
    manifest = source.payload.manifest
    checked = engine.check_lora_shapes(source.name, {n: tuple(s) for n, s in zip(manifest.names, manifest.shapes)})
    if checked.rank != source.rank:
        raise LoRAShapeError(f"LoRA adapter {source.name!r}: its tensors have rank {checked.rank}, the sync says "
                             f"{source.rank}")
    if set(checked.modules) != set(source.target_modules):
        raise LoRATargetError(f"LoRA adapter {source.name!r}: its tensors adapt {sorted(checked.modules)}, the sync "
                              f"says {sorted(source.target_modules)}")


def receive_adapter(receiver: Any, source: AdapterSource) -> AdapterOutcome:
    """Check, receive (checksummed) and commit `source` as the next version of its adapter (see
    module docstring); inside the receiver's one-update-at-a-time lock. Nothing changes on failure."""
    engine, payload, stats = receiver.engine, source.payload, receiver.stats
    try:
        try:
            check_adapter(engine, source)
            refused: Optional[BaseException] = None
        except (KeyError, ValueError) as exc:
            refused = exc
        if isinstance(payload, DistributedSource):
            tensors, received = _over_group(receiver, payload, refused)
        elif refused is not None:
            raise refused  # NOTE: no handshake in shared memory: the sender's segment is simply not read
        else:
            tensors, received = _from_shared_memory(receiver, payload)
        adapter = engine.build_lora(source.name, tensors, alpha=source.alpha, rslora=source.rslora)
        ref = engine.add_lora(adapter, payload.manifest.version)
    except BaseException as exc:
        stats.lora_updates_aborted += 1
        stats.last_error = f"{type(exc).__name__}: {exc}"
        raise
    stats.lora_updates_committed += 1
    stats.lora_bytes_received += received
    stats.last_lora_bytes = received
    return AdapterOutcome(ref.name, ref.version, adapter.rank, received)


def _fresh(manifest: Manifest, device: torch.device) -> dict[str, torch.Tensor]:
    """Memory the new version will own, one tensor per name: the bytes land there once."""
    return {n: torch.empty(s, dtype=d, device=device)
            for n, d, s in zip(manifest.names, manifest.torch_dtypes, manifest.shapes)}


def _over_group(receiver: Any, payload: DistributedSource,
                refused: Optional[BaseException]) -> tuple[dict[str, torch.Tensor], int]:
    group = receiver.group(payload.group_name)
    tensors = _fresh(payload.manifest, group.device)
    try:
        # NOTE: a refusal still takes part in the first agree, so every rank stops before a bucket moves
        received = receive_buckets(group, payload.manifest, refused is None, receiver.group_buffer,
                                   lambda named: None, tensors)
    except GroupError:
        receiver.close_group(payload.group_name)
        raise
    except BaseException:
        if refused is not None:
            raise refused from None  # NOTE: our own reason, not "the manifest was refused"
        raise
    return tensors, received


def _from_shared_memory(receiver: Any, payload: SharedMemorySource) -> tuple[dict[str, torch.Tensor], int]:
    manifest = payload.manifest
    if payload.segment is None:  # NOTE: a GPU trainer's buckets behind CUDA IPC handles
        tensors, received = {}, 0
        for named, nbytes in cuda_ipc_buckets(payload):
            tensors.update({n: t.clone() for n, t in named.items()})
            received += nbytes
        return tensors, received
    tensors = _fresh(manifest, torch.device("cpu"))
    plan = SegmentPlan.of(manifest, payload.piece_bytes)
    destinations = [as_bytes(tensors[n]).numpy() for n in manifest.names]
    received = read_segment(receiver.mappings, payload.segment, plan, payload.token, destinations,
                            receiver.timeout_s, lambda bucket: None)
    return tensors, received


__all__ = ["ADAPTER_TRANSPORTS", "AdapterConfig", "AdapterOutcome", "adapter_config", "check_adapter",
           "peft_adapter", "receive_adapter", "send_adapter"]
