"""WeightSender: the trainer side of weight sync: one call per RL step moves the new weights
into every replica, or into none.

    sender = WeightSender([RolloutClient(a), RolloutClient(b)], Transport.GLOO)
    version = sender.sync(policy, version=step + 1)   # returns once every replica committed

Targets are what the replicas (or a router in front of them) answer to: `WeightControl`
(`update(source, policy)`, the group calls), which `rollout.RolloutClient` implements. Each sync builds the manifest
(names, dtypes, shapes, buckets with their checksums, the version), sends it to every target
first, then moves the bytes, then waits until every target answered (bounded by `timeout_s`).
What moves them is the `Transport`'s object (`weight_sync.transports.table`):

* `gloo` / `nccl`: a weight-update group of the trainer (rank 0, its store listening on
  `master_address` only; beyond loopback only with `trusted_network=True`, since the store has no
  authentication: `transports.distributed`) and the replicas, made at the first sync (targets
  are told to join: `join_group`) and again after a failure or when `regroup()` is called (a
  replica joined or left); buckets are broadcast
  (`transports.bucket_broadcast`). A refused manifest stops every rank before a bucket moves; a failed
  bucket on any replica stops every replica from committing;
* `shm`: buckets in a shared-memory segment that the replicas copy from while the sender fills
  it, `piece_bytes` at a time (CUDA IPC buffers on GPU) (`transports.shared_memory`); same host only;
* `disk`: a safetensors directory per version under `directory` (`transports.disk`); with
  `keep_last=k` the sender deletes the directories it wrote beyond the last k, once every
  replica committed a newer one (None keeps them all: checkpoints).

`delta=True` (gloo / nccl / shm): after a first full sync, each sync sends only what changed since
the last one (`weight_sync.transports.delta`), committed only if every replica's result hashes as
the trainer's full weights; the sender keeps what it last sent as the base (`SentWeights`: one
copy of the model in the replica dtype, on host). A sync is full instead when there is no base
yet, or when the last sync failed (a replica may hold anything); a replica whose version is not
the base's (it restarted, or another sender updated it) gets the same update in full, out of the
delta's own payload, while the others take the delta (every replica's version is asked before a
byte moves; behind a router, from its stats' per-replica versions).

`sync_lora(name, peft_model)` moves one LoRA adapter's tensors alone (gloo / nccl / shm), as the next
version of adapter `name` on every replica (`weight_sync.lora_sync`); the base weights and the
policy version stay as they are.

`tensor_by_tensor=True` (gloo / nccl) does what several frameworks still do: one control call and
one broadcast per tensor, no buckets, no checksums; kept as a contrast (the benchmark prints it).

Trainer layouts: a module's `named_parameters()` (HF names, or megatron-core's fused QKV and
gate/up, which replicas convert), a mapping, or (name, tensor) pairs. A megatron-core model with
tensor parallelism is gathered on its TP rank 0 first (`weight_sync.megatron.tp_gather`); the other TP
ranks return None from `sync`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from weight_sync.buckets import DEFAULT_BUCKET_BYTES
from weight_sync.control import WeightControl
from weight_sync.delta_base import SentWeights
from weight_sync.sources import DEFAULT_GROUP, DEFAULT_PIECE_BYTES
from weight_sync.transports import Transport
from weight_sync.transports.distributed import GroupError, WeightGroup
from weight_sync.transports.shm import RegionPool
from weight_sync.transports.table import BY_TRANSPORT, DELTA

logger = logging.getLogger(__name__)

_DISTRIBUTED = (Transport.GLOO, Transport.NCCL)  # over a weight-update group: `regroup`, `tensor_by_tensor`
Weights = Union[torch.nn.Module, Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


class SyncError(RuntimeError):
    """A sync that did not commit everywhere; `replies` holds each target's answer or error."""

    def __init__(self, message: str, replies: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.replies = list(replies)


@dataclass(slots=True)
class SenderStats:
    syncs: int = 0
    bytes_sent: int = 0  # bytes moved by the transport (before fan-out to replicas)
    last_seconds: float = 0.0
    last_bytes: int = 0
    delta_syncs: int = 0  # syncs that sent a delta (delta mode); the others were full
    last_delta: bool = False
    last_full_replicas: int = 0  # of the last delta sync: replicas not on its base, given it in full
    lora_syncs: int = 0  # adapter-only syncs (`sync_lora`); `last_bytes` counts theirs too


def named_tensors(weights: Weights, *, tp_group: Any = None) -> Optional[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs of a module, mapping or pairs; a megatron-core model with tensor
    parallelism gathered onto its TP rank 0 (None on the others)."""
    if isinstance(weights, torch.nn.Module):
        from weight_sync.megatron.tp_gather import gather_tensor_parallel, tensor_parallel_size

        if tensor_parallel_size(weights, tp_group) > 1:
            return gather_tensor_parallel(weights, tp_group)
        return [(n, p.detach()) for n, p in weights.named_parameters()]
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    return [(n, t.detach()) for n, t in pairs]


class WeightSender:
    """See module docstring. `replicas`: how many engines the targets stand for (a router is one
    target for all of its replicas); `dtype`: cast every tensor to it on the way (e.g. bfloat16
    replicas of an fp32 trainer). `transport` is a `Transport` (its string converts here, the
    one place a plain string is taken).

    The state a transport keeps between syncs lives here, one sender's: `group` (gloo / nccl),
    `regions` and `cuda_buckets` (shm), `written` (disk)."""

    def __init__(self, targets: Sequence[WeightControl], transport: Transport = Transport.GLOO, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 60.0, replicas: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, master_address: str = "127.0.0.1", master_port: int = 0,
                 group_name: str = DEFAULT_GROUP, directory: Optional[str | Path] = None,
                 tensor_by_tensor: bool = False, policy: Any = None, tp_group: Any = None,
                 keep_last: Optional[int] = None, piece_bytes: int = DEFAULT_PIECE_BYTES,
                 trusted_network: bool = False, delta: bool = False) -> None:
        transport = Transport(transport)
        if delta and (transport not in (*_DISTRIBUTED, Transport.SHM) or tensor_by_tensor):
            raise ValueError("delta mode rides the bucketed in-memory transports (gloo / nccl / shm)")
        if transport is Transport.DISK and directory is None:
            raise ValueError("the disk transport needs a directory the replicas can read")
        if tensor_by_tensor and transport not in _DISTRIBUTED:
            raise ValueError("tensor_by_tensor is a torch.distributed mode (gloo / nccl)")
        if not targets:
            raise ValueError("a sender needs at least one target")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be None or >= 1, got {keep_last}")
        self.targets = list(targets)
        self.transport, self.bucket_bytes, self.timeout_s = transport, bucket_bytes, timeout_s
        self.replicas = replicas if replicas is not None else len(self.targets)
        self.dtype, self.policy, self.tp_group = dtype, policy, tp_group
        self.master_address, self.master_port, self.group_name = master_address, master_port, group_name
        self.trusted_network = trusted_network
        self.directory = Path(directory) if directory is not None else None
        self.tensor_by_tensor = tensor_by_tensor
        self.keep_last = keep_last
        self.piece_bytes = piece_bytes
        self.delta = delta
        self.sent: Optional[SentWeights] = None  # delta mode: what every replica committed last
        self.written: list[Path] = []  # the disk transport's version directories, oldest first
        self.version: Optional[int] = None
        self.stats = SenderStats()
        self.group: Optional[WeightGroup] = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, len(self.targets)),
                                                           thread_name_prefix="weight-sender")
        self.regions = RegionPool()
        self.cuda_buckets: list[torch.Tensor] = []  # shm on GPU: alive until every receiver answered

    # ---- the one call --------------------------------------------------------------------------

    def sync(self, weights: Weights, version: Optional[int] = None, *, policy: Any = None,
             full: bool = False) -> Optional[int]:
        """Move `weights` into every replica under `version` (default: the last one + 1, or after a
        failed sync the targets' highest + 1); returns it once every target committed, raises
        `SyncError` (no replica on a mix) otherwise. `full`: a full sync in delta mode too (a
        periodic refresh; the benchmark's contrast)."""
        named = named_tensors(weights, tp_group=self.tp_group)
        if named is None:
            return None  # NOTE: a tensor-parallel rank other than 0: its shards went to rank 0
        original = named
        if self.dtype is not None:
            named = [(n, t.to(self.dtype)) for n, t in named]
        version = self._next_version(version)
        policy = policy if policy is not None else self.policy
        start = time.perf_counter()
        try:
            if self.delta:
                owned = [c is not o for (_, o), (_, c) in zip(original, named)]
                moved = self._sync_delta(named, owned, version, policy, full)
            else:
                moved = BY_TRANSPORT[self.transport].send(self, named, version, policy)
        except BaseException:
            self.version = None  # NOTE: some replicas may have committed it: the next default asks them
            raise
        self.version = version
        self.stats.syncs += 1
        self.stats.bytes_sent += moved
        self.stats.last_bytes = moved
        self.stats.last_seconds = time.perf_counter() - start
        return version

    def sync_lora(self, name: str, adapter: Any, version: Optional[int] = None, *, alpha: Optional[float] = None,
                  rslora: bool = False, adapter_name: str = "default") -> int:
        """Move only LoRA adapter `name`'s tensors into every replica (`weight_sync.lora_sync`) as
        its `version` (None: each replica's next); returns the version once every target committed
        it, raises `SyncError` otherwise. `adapter`: a live PEFT model (its adapter `adapter_name`
        and config), or PEFT-named A/B tensors with `alpha` (and `rslora`)."""
        from weight_sync.lora_sync import adapter_config, peft_adapter, send_adapter

        if hasattr(adapter, "peft_config"):
            named, config = peft_adapter(adapter, adapter_name)
        else:
            if alpha is None:
                raise ValueError("sync_lora of named tensors needs the adapter's alpha")
            named = named_tensors(adapter)
            config = adapter_config(named, alpha=alpha, rslora=rslora)
        if self.dtype is not None:
            named = [(n, t.to(self.dtype)) for n, t in named]
        start = time.perf_counter()
        committed, moved = send_adapter(self, name, named, config, version)
        self.stats.lora_syncs += 1
        self.stats.bytes_sent += moved
        self.stats.last_bytes = moved
        self.stats.last_seconds = time.perf_counter() - start
        return committed

    def _sync_delta(self, named: list[tuple[str, torch.Tensor]], owned: list[bool], version: int, policy: Any,
                    full: bool) -> int:
        """A delta from the base when every target holds it, else a full sync; the base after."""
        named = [(n, t.cpu()) for n, t in named]  # NOTE: the codec runs on host (a GPU trainer pays one copy)
        base, self.sent = self.sent, None  # NOTE: until this sync commits everywhere, no base is trusted
        holding = self._replicas_holding(base.version) if not full and base is not None and base.fits(named) else []
        use_delta = any(holding)
        if use_delta:
            moved = DELTA.send(self, named, version, policy, base, mixed=not all(holding))
        else:
            moved = BY_TRANSPORT[self.transport].send(self, named, version, policy)
        self.sent = SentWeights.keep(named, version, owned)
        self.stats.delta_syncs += use_delta
        self.stats.last_delta = use_delta
        self.stats.last_full_replicas = holding.count(False) if use_delta else 0
        return moved

    def _replicas_holding(self, version: int) -> list[bool]:
        """Whether each replica's policy version is `version`, asked before a byte moves: each
        target's, or behind a router each of its replicas' (its stats name them)."""
        def ask(target: WeightControl) -> list[int]:
            if len(self.targets) != self.replicas and hasattr(target, "stats"):
                stats = target.stats()
                each = [int(v) for k, v in stats.items() if k.startswith("replica/") and k.endswith("/policy_version")]
                if each:
                    return each
            return [int(target.weight_version())]

        try:
            answers = self.collect(self.each(ask), "weight_version")
        except SyncError:
            return []
        return [v == version for versions in answers for v in versions]

    def _next_version(self, version: Optional[int]) -> int:
        if version is not None:
            return version
        if self.version is None:
            self.version = max(int(t.weight_version()) for t in self.targets)
        return self.version + 1

    # ---- the group -----------------------------------------------------------------------------

    def regroup(self) -> None:
        """(Re)make the weight-update group with every target (a replica joined or left)."""
        if self.transport not in _DISTRIBUTED:
            return
        self._close_group()
        world = 1 + self.replicas
        group = WeightGroup.host(self.master_address, self.master_port, world_size=world, name=self.group_name,
                                 backend=self.transport.value, timeout_s=self.timeout_s,
                                 trusted_network=self.trusted_network)
        direct = len(self.targets) == self.replicas  # NOTE: else a router: replicas claim their ranks
        futures = [self._pool.submit(t.join_group, self.master_address, group.port, 1 + i if direct else None,
                                     world, self.group_name, self.transport.value, timeout_s=self.timeout_s)
                   for i, t in enumerate(self.targets)]
        try:
            group.connect()
        except BaseException as exc:
            self.collect(futures, "join_group", exc)
        self.collect(futures, "join_group")
        self.group = group

    def _close_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()

    # ---- what the transports' send sides call --------------------------------------------------

    def each(self, call: Callable[[WeightControl], Any]) -> list[concurrent.futures.Future]:
        """`call(target)` for every target at once, on the sender's threads."""
        return [self._pool.submit(call, t) for t in self.targets]

    def move_then_collect(self, futures: list[concurrent.futures.Future], what: str, move: Callable[[], int]) -> int:
        """`move()` (the bytes, while the targets handle their call), then every target's answer;
        a failure of `move` is reported together with theirs (`SyncError`)."""
        try:
            moved = move()
        except BaseException as exc:
            self.collect(futures, what, exc)
            raise AssertionError("unreachable: collect raises with a failure") from exc
        self.collect(futures, what)
        return moved

    def collect(self, futures: list[concurrent.futures.Future], what: str,
                failure: Optional[BaseException] = None) -> list[Any]:
        """Every target's answer; `SyncError` naming each refusal (and `failure`, ours) if any."""
        deadline = time.monotonic() + self.timeout_s + 5.0
        replies, errors = [], []
        for i, future in enumerate(futures):
            try:
                replies.append(future.result(max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                errors.append(f"target {i}: no answer within {self.timeout_s} s")
                replies.append(None)
            except Exception as exc:  # noqa: BLE001 (each target's answer, reported together)
                errors.append(f"target {i}: {exc}")
                replies.append(exc)
        if failure is not None or errors:
            if isinstance(failure, GroupError):
                self._close_group()
            ours = [f"sender: {failure}"] if failure is not None else []
            raise SyncError(f"{what} failed: " + "; ".join(ours + errors), replies) from failure
        return replies

    def close(self) -> None:
        self._close_group()
        self.regions.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["SenderStats", "SyncError", "WeightSender", "named_tensors"]
