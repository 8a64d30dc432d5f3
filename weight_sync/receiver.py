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
first call with part of the model and no `finish`, as SGLang's callers send, opens one), unless
the update is held (opened by a call with no tensor and `finish` False: vLLM's start phase), which
waits for a commit. An update left open longer than the timeout is aborted.

What reads the bytes is the source's transport object (`weight_sync.transports.table`); the
receiver begins, commits and aborts the staged update around it. The engine's staged update is
the one record of it: a later call of a sequence reads it back (`engine.open_update()`: which
update, its version, the group feeding it, whether it is held; `engine.update_missing()`).

An adapter-only sync (`apply_lora`, `weight_sync.lora_sync`) never opens a staged update of the
base weights: it builds a new version of one LoRA adapter beside the one serving.

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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from inference.errors import EngineStateError, LoRALoadError
from inference.weights.staging import OpenUpdate, Staging
from weight_sync.lora_sync import AdapterOutcome, receive_adapter
from weight_sync.manifest import Manifest, Naming
from weight_sync.megatron.model import MEGATRON_ADAPTER
from weight_sync.sources import DEFAULT_GROUP, AdapterSource, WeightSource
from weight_sync.transports.checkpoint_files import ANYWHERE, DiskAccess, DiskAccessError
from weight_sync.transports.distributed import CollectiveBackend, GroupError, ReceiveBuffer, RefusedError, WeightGroup
from weight_sync.transports.shm import SegmentMappings
from weight_sync.transports.table import BY_SOURCE

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ReceiverStats:
    updates_committed: int = 0
    updates_aborted: int = 0
    bytes_received: int = 0
    last_update_seconds: float = 0.0
    last_error: str = ""
    lora_updates_committed: int = 0  # adapter-only syncs (`weight_sync.lora_sync`)
    lora_updates_aborted: int = 0
    lora_bytes_received: int = 0
    last_lora_bytes: int = 0  # the bytes of the last committed adapter sync

    def wire(self) -> dict[str, Any]:
        """As `weight_sync/<name>` stats entries."""
        return {f"weight_sync/{name}": getattr(self, name) for name in self.__dataclass_fields__}


class WeightReceiver:
    """Weight updates into `engine` (a `DynamicInferenceEngine`), see module docstring.

    `staging`: the default for updates that do not choose; `retain_staging`: keep a double
    update's replaced weights as the next one's buffers (warm copies; a second copy of the
    weights held between updates, freed by suspend); `timeout_s`: the bound of every wait (and of
    reading a checkpoint from disk); `disk_access`: which directories disk updates may read
    (default any: in-process use; a server passes its `--weights-root` directories).

    The state a transport keeps between updates lives here, one receiver's: its weight-update
    groups and `group_buffer` (gloo / nccl), `host_buffer` and `mappings` (shm).
    """

    def __init__(self, engine: Any, *, staging: Staging = Staging.DOUBLE, timeout_s: float = 60.0,
                 retain_staging: bool = True, disk_access: DiskAccess = ANYWHERE) -> None:
        self.engine = engine
        self.disk_access = disk_access
        self.staging = Staging(staging)
        self.timeout_s = timeout_s
        self.retain_staging = retain_staging
        self.stats = ReceiverStats()
        self._busy = threading.Lock()
        self._groups: dict[str, WeightGroup] = {}
        self._watchdog: Optional[threading.Timer] = None
        self.group_buffer = ReceiveBuffer(torch.device("cpu"))  # on the group's device
        self.host_buffer = ReceiveBuffer(torch.device("cpu"))
        self.mappings = SegmentMappings()
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weight-receiver")
        # NOTE: adapter directories are read on a thread of their own: never the engine's loop, and
        # never behind a weight update that waits on its trainer
        self._lora_reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lora-reader")

    # ---- the asynchronous API (the receiver's worker thread) ----------------------------------------

    def apply(self, source: WeightSource, policy: Any = None) -> concurrent.futures.Future:
        """Update from `source` (checked, staged, committed whole) on the worker: an `UpdateOutcome`."""
        return self._submit(lambda: self._outcome(self.update(source, policy)))

    def apply_lora(self, source: AdapterSource) -> concurrent.futures.Future:
        """An adapter-only sync (`weight_sync.lora_sync`) on the worker: an `AdapterOutcome`."""
        def call() -> AdapterOutcome:
            with self._exclusive("a LoRA adapter sync"):
                return receive_adapter(self, source)
        return self._submit(call)

    def load_lora(self, name: str, path: str) -> concurrent.futures.Future:
        """The PEFT adapter directory `path` loaded as `name` (`engine.load_lora`), read on the
        LoRA reader thread where `disk_access` allows (the path as named, then the directory as
        opened: a symlink that leads out is refused too): the engine's `AdapterRef`. The one check
        of a served adapter path, whichever front asked."""
        access = self.disk_access

        def where(real: str) -> None:
            try:
                access.check(real, path)
            except DiskAccessError as exc:
                raise LoRALoadError(f"lora_path: {exc}") from None

        def call() -> Any:
            where(path)  # NOTE: as named, before the filesystem is touched
            return self.engine.load_lora(name, path, where=where)
        return self._lora_reader.submit(call)

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
        transport = BY_SOURCE.get(type(source))
        if transport is None:
            raise TypeError(f"no weight source {type(source).__name__}")
        with self._exclusive("a weight update"):
            return transport.receive(self, source, policy)

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
            self.close_group(group_name)
            on_gpu = self.engine.model.device.type == "cuda"
            backend = CollectiveBackend.of(backend or (CollectiveBackend.NCCL if on_gpu else CollectiveBackend.GLOO))
            device = self.engine.model.device if backend is CollectiveBackend.NCCL else None
            group = WeightGroup.join(master_address, master_port, world_size=world_size, rank=rank_offset,
                                     name=group_name, backend=backend, timeout_s=timeout_s or self.timeout_s,
                                     device=device)
            self._groups[group_name] = group
            if group.device.type == "cuda":
                self.group_buffer = ReceiveBuffer(group.device)
            logger.info("joined weight-update group %s as rank %d of %d", group_name, group.rank, world_size)
            return group.rank

    def destroy_group(self, group_name: str = DEFAULT_GROUP) -> bool:
        with self._exclusive("destroy_weights_update_group"):
            return self.close_group(group_name)

    def group(self, name: str) -> WeightGroup:
        """The weight-update group `name` this replica joined."""
        group = self._groups.get(name)
        if group is None:
            raise ValueError(f"no weight-update group {name!r} here: init_weights_update_group first")
        return group

    def close_group(self, name: str) -> bool:
        group = self._groups.pop(name, None)
        if group is not None:
            group.close()
        return group is not None

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._lora_reader.shutdown(wait=False, cancel_futures=True)
        for name in list(self._groups):
            self.close_group(name)
        self.mappings.close()

    # ---- the staged update: what the transports' receive sides call ----------------------------

    def staged(self, version: Optional[int], staging: Optional[Staging], policy: Any,
               load: Callable[[], None], *, partial: bool = False) -> int:
        """One update in one call: begin, `load()` the bytes into it, commit; any failure aborts.
        `partial`: the tensors not loaded stay as they are (a delta's unchanged ones)."""
        start = time.perf_counter()
        try:
            self.begin(version, staging, partial=partial)
            load()
            return self.commit(policy, start)
        except BaseException as exc:
            self.abort(exc)
            raise

    def open_update(self) -> Optional[OpenUpdate]:
        """The engine's open update (a sequence left open by the last call), if any; its expiry is
        off (this call decides)."""
        self._cancel_watchdog()
        return self.engine.open_update()

    def begin(self, version: Optional[int], staging: Optional[Staging], group: str = "", *,
              partial: bool = False, held: bool = False) -> OpenUpdate:
        """Open the engine's staged update, fed over `group` ("" a single call); `held`: it stays
        open until a call commits it, however complete (vLLM's start phase)."""
        staging = Staging(staging or self.staging)
        retain = self.retain_staging and staging is Staging.DOUBLE
        self.engine.begin_update(version, staging, partial=partial, retain_staging=retain, origin=group, held=held)
        return self.engine.open_update()

    def keep_open(self, opened: OpenUpdate) -> None:
        """`opened` waits for the sequence's next call, at most `timeout_s`."""
        self._arm_watchdog(opened)

    def complete(self) -> bool:
        """Whether the open update holds every tensor of the model."""
        return not self.engine.update_missing()

    def commit(self, policy: Any, start: float) -> int:
        version = self.engine.commit_update(policy)
        self.stats.updates_committed += 1
        self.stats.last_update_seconds = time.perf_counter() - start
        return version

    def abort(self, why: BaseException) -> None:
        self._cancel_watchdog()
        self.stats.updates_aborted += 1
        self.stats.last_error = f"{type(why).__name__}: {why}"
        try:
            self.engine.abort_update()
        except Exception:  # noqa: BLE001 (the original failure is what the caller hears)
            logger.exception("aborting the weight update failed")
        logger.warning("weight update aborted: %s", self.stats.last_error)

    def load(self, named: Mapping[str, torch.Tensor], naming: Naming) -> None:
        """Tensors into the open update; megatron-core names through their adapter."""
        self.engine.load_weights(named, MEGATRON_ADAPTER if naming is Naming.MEGATRON else None)

    def staging_buffers(self, manifest: Manifest, device: torch.device) -> dict[str, torch.Tensor]:
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

    def _arm_watchdog(self, opened: OpenUpdate) -> None:
        timer = threading.Timer(self.timeout_s, self._expire, args=(opened,))
        timer.daemon = True
        self._watchdog = timer
        timer.start()

    def _cancel_watchdog(self) -> None:
        timer, self._watchdog = self._watchdog, None
        if timer is not None:
            timer.cancel()

    def _expire(self, opened: OpenUpdate) -> None:
        if not self._busy.acquire(blocking=False):
            return  # NOTE: the next call is running: it decides
        try:
            now = self.engine.open_update()
            if now is not None and now.serial == opened.serial:
                self.abort(TimeoutError(f"the update to version {opened.version} waited {self.timeout_s} s for "
                                         "its next call"))
        finally:
            self._busy.release()


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


__all__ = ["OpenUpdate", "ReceiverStats", "UpdateOutcome", "WeightReceiver"]

