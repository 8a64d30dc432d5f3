"""WeightReceiver: the engine side of weight sync, whatever the transport.

Every update goes the same way: the manifest is checked against the engine's model before a byte
is accepted (a manifest for another model is refused then); a staged update opens
(`begin_update`, `double` staging by default: the old weights serve until the commit); each bucket
is checked against its checksum and handed to `load_weights`: the bytes either arrived straight in
buffers the engine handed out for the update (`staging_buffers`: gloo, NCCL and shm into a double
update the engine can take as named), which it adopts, or it copies them into memory it owns; the
version changes only at `commit_update`. Any failure (a checksum, a missing
bucket, a dead sender, a timeout) aborts: `double` leaves the old weights serving, `in_place`
refuses to generate, with a clear error, until the next complete update. Nothing waits past the
update's timeout.

A sequence of SGLang-style calls is one staged update: a `DistributedSource` with `finish` False
keeps it open for the next call, True commits it, None commits it once the model is complete (a
first call with part of the model and no `finish`, as SGLang's callers send, opens one). An
update left open longer than the timeout is aborted.

One update (or group change) runs at a time; a second one meanwhile is refused at once. The
receiver owns its weight-update groups (`init_group` / `destroy_group`); a group whose collective
failed is closed and forgotten (the trainer makes a new one).

`apply`, `join_group` and `leave_group` run on the receiver's own worker thread and return a
`Future`, so a server's socket thread never waits on a transfer. Their failures are the
receiver's error contract: a `ValueError` is the request's fault (a manifest for another model,
a path that is no checkpoint, a bad checksum), an `EngineStateError` what left the engine unable
to complete it (a dead sender, a broken group, a timeout, another update in flight).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from inference.errors import EngineStateError
from inference.weights.staging import Staging
from weight_sync.buckets import as_bytes, bucket_checksum, unpack_bucket
from weight_sync.manifest import (
    ChecksumError,
    Manifest,
    ManifestError,
    check_against_model,
    dtype_name,
)
from weight_sync.sources import DiskSource, DistributedSource, SharedMemorySource, WeightSource, source_version
from weight_sync.transports import disk
from weight_sync.transports.bucket_broadcast import receive_buckets, receive_tensors
from weight_sync.transports.distributed import DEFAULT_GROUP, GroupError, ReceiveBuffer, RefusedError, WeightGroup
from weight_sync.transports.shm import SegmentMappings, SegmentPlan, import_cuda, read_segment

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Open:
    """A staged update spanning several calls."""

    version: Optional[int]
    group: str
    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    deadline: float = 0.0


@dataclass(slots=True)
class ReceiverStats:
    updates_committed: int = 0
    updates_aborted: int = 0
    bytes_received: int = 0
    last_update_seconds: float = 0.0
    last_error: str = ""

    def wire(self) -> dict[str, Any]:
        """As `weight_sync/<name>` stats entries."""
        return {f"weight_sync/{name}": getattr(self, name) for name in self.__dataclass_fields__}


class WeightReceiver:
    """Weight updates into `engine` (a `DynamicInferenceEngine`), see module docstring.

    `staging`: the default for updates that do not choose; `retain_staging`: keep a double
    update's replaced weights as the next one's buffers (warm copies; a second copy of the
    weights held between updates, freed by suspend); `timeout_s`: the bound of every wait.
    """

    def __init__(self, engine: Any, *, staging: Staging = Staging.DOUBLE, timeout_s: float = 60.0,
                 retain_staging: bool = True) -> None:
        self.engine = engine
        self.staging = Staging(staging)
        self.timeout_s = timeout_s
        self.retain_staging = retain_staging
        self.stats = ReceiverStats()
        self._busy = threading.Lock()
        self._groups: dict[str, WeightGroup] = {}
        self._open: Optional[_Open] = None
        self._watchdog: Optional[threading.Timer] = None
        self._buffer = ReceiveBuffer(torch.device("cpu"))  # the group's device
        self._host_buffer = ReceiveBuffer(torch.device("cpu"))
        self._mappings = SegmentMappings()
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-receiver")

    # ---- the asynchronous API (the receiver's worker thread) ----------------------------------------

    def apply(self, source: WeightSource, policy: Any = None) -> concurrent.futures.Future:
        """Update from `source` (checked, staged, committed whole) on the worker: an `UpdateOutcome`."""
        return self._submit(lambda: self._outcome(self.update(source, policy)))

    def join_group(self, master_address: str, master_port: int, rank_offset: Optional[int], world_size: int,
                   group_name: str = DEFAULT_GROUP, backend: Optional[str] = None,
                   timeout_s: Optional[float] = None) -> concurrent.futures.Future:
        """`init_group` on the worker: this replica's rank."""
        return self._submit(lambda: self.init_group(master_address, master_port, rank_offset, world_size, group_name,
                                                    backend, timeout_s))

    def leave_group(self, group_name: str = DEFAULT_GROUP) -> concurrent.futures.Future:
        """`destroy_group` on the worker: whether there was one."""
        return self._submit(lambda: self.destroy_group(group_name))

    def _submit(self, call: Callable[[], Any]) -> concurrent.futures.Future:
        return self._worker.submit(_typed_errors, call)

    def _outcome(self, committed: Optional[int]) -> UpdateOutcome:
        return UpdateOutcome(committed is not None, self.engine.policy_version, self.stats.bytes_received)

    def update(self, source: WeightSource, policy: Any = None) -> Optional[int]:
        """Update from any source, on the caller's thread: the new version, or None while a
        sequence of distributed calls stays open."""
        if isinstance(source, DiskSource):
            return self.update_from_disk(source.path, version=source.version, policy=policy)
        if isinstance(source, DistributedSource):
            return self.update_from_distributed(source, policy=policy)
        if isinstance(source, SharedMemorySource):
            return self.update_from_shared_memory(source, policy=policy)
        raise TypeError(f"no weight source {type(source).__name__}")

    @property
    def spec(self):
        return self.engine.model.spec

    @property
    def weight_version(self) -> str:
        return str(self.engine.policy_version)

    @contextlib.contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise EngineStateError(f"{what} refused: another weight update or group change is in flight here")
        try:
            yield
        finally:
            self._busy.release()

    # ---- groups --------------------------------------------------------------------------------

    def init_group(self, master_address: str, master_port: int, rank_offset: Optional[int], world_size: int,
                   group_name: str = DEFAULT_GROUP, backend: Optional[str] = None,
                   timeout_s: Optional[float] = None) -> int:
        """Join (again) the weight-update group `group_name`; returns this replica's rank.
        `rank_offset` None claims the next free rank (one message broadcast to all replicas)."""
        with self._exclusive("init_weights_update_group"):
            self._close_group(group_name)
            if backend is None:
                backend = "nccl" if self.engine.model.device.type == "cuda" else "gloo"
            device = self.engine.model.device if backend == "nccl" else None
            group = WeightGroup.join(master_address, master_port, world_size=world_size, rank=rank_offset,
                                     name=group_name, backend=backend, timeout_s=timeout_s or self.timeout_s,
                                     device=device)
            self._groups[group_name] = group
            if group.device.type == "cuda":
                self._buffer = ReceiveBuffer(group.device)
            logger.info("joined weight-update group %s as rank %d of %d", group_name, group.rank, world_size)
            return group.rank

    def destroy_group(self, group_name: str = DEFAULT_GROUP) -> bool:
        with self._exclusive("destroy_weights_update_group"):
            return self._close_group(group_name)

    def _close_group(self, name: str) -> bool:
        group = self._groups.pop(name, None)
        if group is not None:
            group.close()
        return group is not None

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        for name in list(self._groups):
            self._close_group(name)
        self._mappings.close()

    # ---- updates -------------------------------------------------------------------------------

    def update_from_distributed(self, source: DistributedSource, *, policy: Any = None) -> Optional[int]:
        """Receive `source` over its group; the new version once committed, None while a sequence
        stays open (`finish` False, or None with tensors still missing)."""
        manifest = source.manifest
        with self._exclusive("a weight update"):
            self._cancel_watchdog()
            group = self._groups.get(source.group_name)
            if group is None:
                raise EngineStateError(f"no weight-update group {source.group_name!r} here: "
                                       "init_weights_update_group first")
            opened = self._open
            sequence = opened is not None or source.finish is False
            if not sequence and source.finish is None and not _whole_model(manifest, self.spec):
                sequence = True  # NOTE: SGLang's callers send part of the model per call, and no `finish`
            try:
                version = _sequence_version(manifest, opened)
                check_against_model(manifest, self.spec, complete=not sequence)
                accepted = None
            except (ManifestError, KeyError, ValueError) as exc:
                accepted = exc
            if accepted is not None:
                self._refuse_distributed(group, manifest, accepted)
            start = time.perf_counter()
            try:
                if opened is None:
                    opened = self._begin(version, source.staging, source.group_name)
                elif opened.group != source.group_name:
                    raise ValueError(f"the open update came over group {opened.group!r}, this call over "
                                     f"{source.group_name!r}")
                if manifest.layout is None:
                    received = receive_tensors(group, manifest, self.engine.load_weights)
                else:
                    direct = self._staging_buffers(manifest, group.device)
                    received = receive_buckets(group, manifest, True, self._buffer, self.engine.load_weights, direct)
                self.stats.bytes_received += received
                opened.names += manifest.names
                opened.dtypes += manifest.dtypes
                opened.shapes += manifest.shapes
                if source.finish is False or (source.finish is None and not self._complete(opened)):
                    opened.deadline = time.monotonic() + self.timeout_s
                    self._arm_watchdog(opened)
                    return None
                return self._commit(policy, start)
            except BaseException as exc:
                self._abort(exc)
                if isinstance(exc, GroupError):
                    self._close_group(source.group_name)
                raise

    def _refuse_distributed(self, group: WeightGroup, manifest: Manifest, why: BaseException) -> None:
        """Say no in step with the sender, so it is not left waiting, then raise `why`."""
        try:
            if manifest.layout is not None:
                group.agree(False)
            else:  # NOTE: SGLang's calls have no handshake: drain the broadcasts it will send anyway
                receive_tensors(group, manifest, lambda named: None)
        except GroupError:
            self._close_group(group.name)
        self._abort(why)
        raise why

    def update_from_shared_memory(self, source: SharedMemorySource, *, policy: Any = None) -> int:
        """Copy the buckets of a shared-memory source in (checked, staged, committed)."""
        manifest = source.manifest
        with self._exclusive("a weight update"):
            check_against_model(manifest, self.spec)
            start = time.perf_counter()
            try:
                self._begin(source_version(source), source.staging, "")
                if source.segment is not None:
                    self._read_segment(source)
                else:
                    self._read_cuda_ipc(source)
                return self._commit(policy, start)
            except BaseException as exc:
                self._abort(exc)
                raise

    def _read_segment(self, source: SharedMemorySource) -> None:
        """Pieces straight into the engine's staging buffers where it can take them as they are,
        else into a scratch buffer that `load_weights` copies from."""
        manifest = source.manifest
        layout = manifest.layout
        plan = SegmentPlan.of(manifest, source.piece_bytes)
        direct = self._staging_buffers(manifest, torch.device("cpu"))
        scratch = None if len(direct) == len(manifest.names) else self._host_buffer.get(plan.data_bytes)
        tensors: dict[str, torch.Tensor] = {}
        for b, (bucket, at) in enumerate(zip(layout.buckets, layout.region_offsets())):
            tensors.update(unpack_bucket(manifest, b, None if scratch is None else scratch[at : at + bucket.nbytes],
                                         direct))
        destinations = [as_bytes(tensors[name]).numpy() for name in manifest.names]

        def load(b: int) -> None:
            bucket = layout.buckets[b]
            self.engine.load_weights({n: tensors[n] for n in manifest.names[bucket.start : bucket.stop]})
            self.stats.bytes_received += bucket.nbytes

        read_segment(self._mappings, source.segment, plan, source.token, destinations, self.timeout_s, load)

    def _staging_buffers(self, manifest: Manifest, device: torch.device) -> dict[str, torch.Tensor]:
        """The engine's own buffers for the manifest's tensors it holds as named, in its dtype, on
        `device`, in a double-staged update; {} when it takes none that way."""
        expected, dtype = self.spec.weight_shapes(), self.spec.dtype
        names = [n for n, d in zip(manifest.names, manifest.torch_dtypes) if n in expected and d == dtype]
        if not names or self.engine.model.device != device:
            return {}
        try:
            return self.engine.staging_buffers(names)
        except EngineStateError:  # NOTE: in place, or an MoE rank: load_weights copies
            return {}

    def _read_cuda_ipc(self, source: SharedMemorySource) -> None:
        manifest = source.manifest
        for index, bucket in enumerate(manifest.layout.buckets):
            view = import_cuda(source.cuda_ipc[index], bucket.nbytes)
            _verify(view, manifest, index)
            self.engine.load_weights(unpack_bucket(manifest, index, view))
            self.stats.bytes_received += bucket.nbytes
            del view  # NOTE: the engine copied every byte; the mapping goes with the last view

    def update_from_disk(self, path: str | Path, *, version: Optional[int] = None, policy: Any = None,
                         staging: Optional[Staging] = None) -> int:
        """Load a safetensors directory: bucket by bucket against its manifest's checksums if it
        has one (`weight_sync.transports.disk`), else whole (any HF checkpoint)."""
        path = Path(path)
        with self._exclusive("a weight update"):
            manifest = disk.read_manifest(path)
            start = time.perf_counter()
            if manifest is None:
                from inference.models.loading import read_safetensors

                tensors = read_safetensors(path, None)
                manifest = Manifest(names=list(tensors), dtypes=[dtype_name(t.dtype) for t in tensors.values()],
                                    shapes=[list(t.shape) for t in tensors.values()])
                check_against_model(manifest, self.spec)
                try:
                    self._begin(version, staging, "")
                    self.engine.load_weights(tensors)
                    return self._commit(policy, start)
                except BaseException as exc:
                    self._abort(exc)
                    raise
            if version is not None and manifest.version is not None and version != manifest.version:
                raise ManifestError(f"{path}: the source says version {version}, the directory's manifest "
                                    f"{manifest.version}")
            check_against_model(manifest, self.spec)
            try:
                self._begin(manifest.version if version is None else version, staging, "")
                for index, bucket in enumerate(manifest.layout.buckets):
                    tensors, checksum = disk.read_bucket(path, manifest, index)
                    if checksum != bucket.checksum:
                        raise ChecksumError(f"{disk.bucket_file(index, manifest.num_buckets)}: checksum "
                                            f"{checksum:#x}, the manifest says {bucket.checksum:#x}")
                    self.engine.load_weights(tensors)
                    self.stats.bytes_received += bucket.nbytes
                return self._commit(policy, start)
            except BaseException as exc:
                self._abort(exc)
                raise

    # ---- the staged update ---------------------------------------------------------------------

    def _begin(self, version: Optional[int], staging: Optional[Staging], group: str) -> _Open:
        staging = Staging(staging or self.staging)
        retain = self.retain_staging and staging is Staging.DOUBLE
        self.engine.begin_update(version, staging, retain_staging=retain)
        self._open = _Open(version, group)
        return self._open

    def _complete(self, opened: _Open) -> bool:
        so_far = Manifest(names=opened.names, dtypes=opened.dtypes, shapes=opened.shapes)
        try:
            check_against_model(so_far, self.spec, complete=True)
        except (KeyError, ValueError):
            return False
        return True

    def _commit(self, policy: Any, start: float) -> int:
        version = self.engine.commit_update(policy)
        self._open = None
        self.stats.updates_committed += 1
        self.stats.last_update_seconds = time.perf_counter() - start
        return version

    def _abort(self, why: BaseException) -> None:
        self._cancel_watchdog()
        self._open = None
        self.stats.updates_aborted += 1
        self.stats.last_error = f"{type(why).__name__}: {why}"
        try:
            self.engine.abort_update()
        except Exception:  # noqa: BLE001 (the original failure is what the caller hears)
            logger.exception("aborting the weight update failed")
        logger.warning("weight update aborted: %s", self.stats.last_error)

    def _arm_watchdog(self, opened: _Open) -> None:
        timer = threading.Timer(self.timeout_s, self._expire, args=(opened,))
        timer.daemon = True
        self._watchdog = timer
        timer.start()

    def _cancel_watchdog(self) -> None:
        timer, self._watchdog = self._watchdog, None
        if timer is not None:
            timer.cancel()

    def _expire(self, opened: _Open) -> None:
        if not self._busy.acquire(blocking=False):
            return  # NOTE: the next call is running: it decides
        try:
            if self._open is opened:
                self._abort(TimeoutError(f"the update to version {opened.version} waited {self.timeout_s} s for "
                                         "its next call"))
        finally:
            self._busy.release()


def _sequence_version(manifest: Manifest, opened: Optional[_Open]) -> Optional[int]:
    """The version of a call of a sequence: its manifest's, which a later call must not contradict."""
    if opened is None:
        return manifest.version
    if manifest.version is None or opened.version is None:
        return opened.version
    if manifest.version != opened.version:
        raise ManifestError(f"this call's manifest says version {manifest.version}, the open update's is "
                            f"{opened.version}")
    return manifest.version


@dataclass(frozen=True, slots=True)
class UpdateOutcome:
    """What an `apply` did: whether it committed (False: a sequence stays open), the engine's
    version after it, and the bytes received so far."""

    committed: bool
    version: int
    bytes_received: int


def _typed_errors(call: Callable[[], Any]) -> Any:
    """The receiver's error contract (see module docstring)."""
    try:
        return call()
    except FileNotFoundError as exc:
        raise ValueError(f"source.path: {exc}") from exc
    except (GroupError, RefusedError, TimeoutError) as exc:
        raise EngineStateError(f"weight update aborted: {exc}") from exc
    except KeyError as exc:  # NOTE: WeightNameError: a manifest for another model
        raise ValueError(str(exc)) from exc
    except OSError as exc:  # NOTE: a path the replica cannot read as a checkpoint: the request's fault
        raise ValueError(f"source.path: {type(exc).__name__}: {exc}") from exc


def _verify(view: torch.Tensor, manifest: Manifest, index: int) -> None:
    bucket = manifest.layout.buckets[index]
    checksum = bucket_checksum(view, bucket)
    if checksum != bucket.checksum:
        raise ChecksumError(f"bucket {index} of {manifest.num_buckets} ({bucket.nbytes} bytes): checksum "
                            f"{checksum:#x}, the manifest says {bucket.checksum:#x}")


__all__ = ["ReceiverStats", "UpdateOutcome", "WeightReceiver"]


def _whole_model(manifest: Any, spec: Any) -> bool:
    try:
        check_against_model(manifest, spec, complete=True)
    except (ManifestError, KeyError, ValueError):
        return False
    return True
