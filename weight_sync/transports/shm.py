"""Shared memory on one host: CPU buckets in a /dev/shm segment, GPU buckets as CUDA IPC handles.

CPU. The sender keeps one `SharedRegion` (a file under /dev/shm mapped into its memory, reused
across syncs while it is large enough, so its pages stay warm): a header of one slot per piece,
then the buckets back to back. It sends the `SharedMemorySource` first and fills the segment
while the replicas copy it: the data is cut into `piece_bytes` pieces (`SegmentPlan`), and once
a piece's tensor bytes are copied in (streaming stores, its checksum summed on the way,
`weight_sync.memcopy`) the sender publishes the checksum and this update's random token in the
piece's slot. A replica maps the segment read-only (`read_segment`), waits for each piece's
token, copies the piece's bytes straight into buffers its engine owns (summing them on the way)
and compares the sums; a bucket whose pieces all arrived is loaded. Packing and copying overlap,
and the only copies are the sender's one and each replica's one. The sender reuses the region
only after every receiver answered. A replica keeps its mapping for the next update while the
sender keeps the segment, and closes it within a second once the sender unlinks it or exits
(`SegmentMappings`): it never holds memory the sender gave up, and its weights are its own.

On GPU the buckets stay in the sender's device memory and travel as CUDA IPC handles
(`CudaIpcBuffer`, the fields of `torch.UntypedStorage._share_cuda_()`), opened by the receiver
with `_new_shared_cuda` and copied the same way. The handle is plain msgpack, never pickle.

Segment names are `rollout-wsync-<pid>-<random>`; a receiver opens nothing else, and gives up
early when that pid (alive when the update began) exits before publishing every piece. A sender
killed before it unlinks its segment leaves it behind: `remove_stale_segments()`, run whenever a
sender's `RegionPool` or a receiver's `SegmentMappings` is made, removes those whose process is
gone. A live sender holds a shared `flock` on its segment for as long as it keeps it, so a segment
whose pid means nothing here (a sender in another pid namespace sharing /dev/shm) is left alone
while its sender lives.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch

from weight_sync import memcopy
from weight_sync.manifest import ChecksumError, Manifest
from weight_sync.sources import (  # NOTE: the segment's name and pieces as the wire carries them
    DEFAULT_PIECE_BYTES,
    SEGMENT_NAME,
    SEGMENT_PREFIX,
    CudaIpcBuffer,
    check_segment_name,
)

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_PAGE = 4096
_POLL_S = 0.1  # how often a waiting receiver checks that the sender still lives


def sender_pid(name: str) -> int:
    """The pid of the process that made segment `name` (checked to be one of ours)."""
    return int(SEGMENT_NAME.fullmatch(check_segment_name(name)).group(1))


class SharedRegion:
    """The sender's segment (see module docstring); `tensor` is its bytes, writable."""

    def __init__(self, nbytes: int) -> None:
        self.name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.path = SHM_DIR / self.name
        self.nbytes = nbytes
        storage = torch.UntypedStorage.from_file(str(self.path), shared=True, nbytes=max(1, nbytes))
        self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._lock_fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(self._lock_fd, fcntl.LOCK_SH)  # NOTE: released by the kernel however this process ends

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.path.unlink()
        except (FileNotFoundError, AttributeError, TypeError):
            pass
        fd = getattr(self, "_lock_fd", -1)
        if fd >= 0:
            os.close(fd)


class RegionPool:
    """The sender's one region, grown when a sync needs more (the old one is unlinked). A new
    pool first removes the segments killed senders left behind."""

    def __init__(self) -> None:
        self.region: Optional[SharedRegion] = None
        _remove_stale_logged()

    def get(self, nbytes: int) -> SharedRegion:
        if self.region is None or self.region.nbytes < nbytes:
            if self.region is not None:
                self.region.close()
            self.region = SharedRegion(nbytes)
        return self.region

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
            self.region = None


@dataclass(slots=True)
class SegmentPlan:
    """Where everything lies in a segment, derived alike by sender and receivers from the manifest
    and `piece_bytes`: `header_bytes` of slots (token, checksum), then the data, whose piece `k`
    is `[k * piece_bytes, (k + 1) * piece_bytes)`. `pieces[k]`: the (tensor index, first byte,
    end byte) spans of tensor bytes in it; `buckets_done[k]`: the buckets whose last byte it holds."""

    piece_bytes: int
    header_bytes: int
    data_bytes: int
    starts: list[int]  # each tensor's first byte in the data
    pieces: list[list[tuple[int, int, int]]]
    buckets_done: list[list[int]]

    @classmethod
    def of(cls, manifest: Manifest, piece_bytes: int = DEFAULT_PIECE_BYTES) -> SegmentPlan:
        layout = manifest.layout
        assert layout is not None
        sizes = manifest.tensor_bytes()
        data_bytes = manifest.total_bytes
        count = max(1, -(-data_bytes // piece_bytes))
        starts = [0] * len(sizes)
        pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
        buckets_done: list[list[int]] = [[] for _ in range(count)]
        for b, (bucket, base) in enumerate(zip(layout.buckets, layout.region_offsets())):
            buckets_done[max(0, base + bucket.nbytes - 1) // piece_bytes].append(b)
            for i in range(bucket.start, bucket.stop):
                start = starts[i] = base + layout.offsets[i]
                lo = 0
                while lo < sizes[i]:
                    k = (start + lo) // piece_bytes
                    hi = min(sizes[i], (k + 1) * piece_bytes - start)
                    pieces[k].append((i, lo, hi))
                    lo = hi
        header = -(-16 * count // _PAGE) * _PAGE
        return cls(piece_bytes, header, data_bytes, starts, pieces, buckets_done)

    @property
    def segment_bytes(self) -> int:
        return self.header_bytes + self.data_bytes


def fill_segment(region: SharedRegion, plan: SegmentPlan, sources: Sequence[np.ndarray], token: int) -> int:
    """The sender's side: copy every piece's tensor bytes (`sources`: each tensor's bytes, flat
    uint8) into the region and publish it; returns the data bytes."""
    whole = region.tensor.numpy()
    header = whole[: plan.header_bytes].view(np.uint64)
    data = whole[plan.header_bytes : plan.segment_bytes]
    for k, spans in enumerate(plan.pieces):
        total = 0
        for i, lo, hi in spans:
            at = plan.starts[i]
            total += memcopy.copy_sum(data[at + lo : at + hi], sources[i][lo:hi])
        memcopy.publish(header, k, total & memcopy.MASK, token)
    return plan.data_bytes


def read_segment(mappings: SegmentMappings, name: str, plan: SegmentPlan, token: int,
                 destinations: Sequence[np.ndarray], timeout_s: float, on_bucket: Callable[[int], None]) -> int:
    """A receiver's side: copy each piece, as soon as it is published, into `destinations` (each
    tensor's bytes, flat uint8, memory the receiver owns), checking its checksum; `on_bucket(b)`
    once bucket `b` is complete. Raises `ChecksumError`, `TimeoutError` (nothing published within
    `timeout_s` of the start) or `ConnectionError` (the sender exited first). Returns the bytes."""
    sender = sender_pid(name)
    watch_sender = _alive(sender)  # NOTE: in another pid namespace the pid means nothing here
    with mappings.use(name, plan.segment_bytes) as mapping:
        whole = np.frombuffer(mapping, dtype=np.uint8, count=plan.segment_bytes)
        header = whole[: plan.header_bytes].view(np.uint64)
        deadline = time.monotonic() + timeout_s
        try:
            for k, spans in enumerate(plan.pieces):
                expected = _wait_piece(header, k, token, deadline, sender if watch_sender else None, name)
                total = 0
                for i, lo, hi in spans:
                    at = plan.header_bytes + plan.starts[i]
                    total += memcopy.copy_sum(destinations[i][lo:hi], whole[at + lo : at + hi])
                if total & memcopy.MASK != expected:
                    raise ChecksumError(f"piece {k} of {len(plan.pieces)} (bytes {k * plan.piece_bytes}..) of segment "
                                        f"{name}: checksum {total & memcopy.MASK:#x}, the sender published "
                                        f"{expected:#x}")
                for b in plan.buckets_done[k]:
                    on_bucket(b)
        finally:
            del whole, header  # NOTE: no view may outlive the mapping's use
    return plan.data_bytes


class _Mapped(NamedTuple):
    name: str
    inode: int
    mapping: mmap.mmap
    nbytes: int


class SegmentMappings:
    """A receiver's read-only mapping of its sender's segment, kept from one update to the next.

    Mapping 400 MB of 4 KiB pages and unmapping it costs a receiver more than copying the bytes
    (26 ms against 20 ms on one core), so the mapping of the segment last used stays while the
    sender keeps the segment. It never keeps memory alive that the sender gave up: every
    `check_every_s` (and at each update) a mapping whose file was unlinked or replaced, or whose
    sender exited, is closed, as is one idle for `idle_s`. The weights themselves are always
    copies in memory the engine owns. One mapping at a time (a replica has one sender)."""

    def __init__(self, *, check_every_s: float = 1.0, idle_s: float = 600.0) -> None:
        self.check_every_s, self.idle_s = check_every_s, idle_s
        _remove_stale_logged()  # NOTE: a receiver (re)starting after its sender was killed cleans up for it
        self._lock = threading.Lock()
        self._current: Optional[_Mapped] = None
        self._last_used = 0.0
        self._timer: Optional[threading.Timer] = None

    @contextlib.contextmanager
    def use(self, name: str, nbytes: int) -> Iterator[mmap.mmap]:
        with self._lock:
            path = SHM_DIR / check_segment_name(name)
            current = self._current
            reusable = current is not None and current.name == name and current.nbytes >= nbytes
            if current is not None and not (reusable and _same_file(path, current.inode)):
                self._close_locked()
                current = None
            if current is None:
                current = self._current = _Mapped(name, *_map_read_only(path, nbytes), nbytes)
            try:
                yield current.mapping
            finally:
                self._last_used = time.monotonic()
                self._arm()

    @property
    def mapped(self) -> Optional[str]:
        """The name of the segment mapped now, if any."""
        current = self._current
        return current.name if current is not None else None

    def close(self) -> None:
        with self._lock:
            self._close_locked()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _arm(self) -> None:
        if self._current is not None and (self._timer is None or not self._timer.is_alive()):
            self._timer = threading.Timer(self.check_every_s, self._check)
            self._timer.daemon = True
            self._timer.start()

    def _check(self) -> None:
        if not self._lock.acquire(blocking=False):
            self._timer = None
            self._arm()  # NOTE: an update is using it: look again later
            return
        try:
            self._timer = None
            current = self._current
            if current is None:
                return
            idle = time.monotonic() - self._last_used > self.idle_s
            if idle or not _same_file(SHM_DIR / current.name, current.inode) or not _alive(sender_pid(current.name)):
                self._close_locked()
            else:
                self._arm()
        finally:
            self._lock.release()

    def _close_locked(self) -> None:
        current, self._current = self._current, None
        if current is not None:
            try:
                current.mapping.close()
            except BufferError:  # NOTE: a view lives on in a traceback: the mapping goes with it
                pass


def _wait_piece(header: np.ndarray, k: int, token: int, deadline: float, sender: Optional[int], name: str) -> int:
    while True:
        left = deadline - time.monotonic()
        checksum = memcopy.wait(header, k, token, max(0.0, min(_POLL_S, left)))
        if checksum is not None:
            return checksum
        if sender is not None and not _alive(sender):
            # NOTE: the sender may have published it just before exiting
            checksum = memcopy.wait(header, k, token, 0.0)
            if checksum is not None:
                return checksum
            raise ConnectionError(f"the sender (pid {sender}) exited before publishing piece {k} of segment {name}")
        if left <= 0:
            raise TimeoutError(f"piece {k} of segment {name} was not published within the update's timeout")


def _map_read_only(path: Path, nbytes: int) -> tuple[int, mmap.mmap]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(f"shared-memory segment {path.name} is gone (the sender exited?)") from None
    try:
        info = os.fstat(fd)
        if info.st_size < nbytes:
            raise ValueError(f"shared-memory segment {path.name} holds {info.st_size} bytes, the manifest needs "
                             f"{nbytes}")
        return info.st_ino, mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _same_file(path: Path, inode: int) -> bool:
    try:
        return path.stat().st_ino == inode
    except FileNotFoundError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments() -> list[str]:
    """Unlink the segments whose sender is gone (see module docstring); their names."""
    removed = []
    for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}*"):
        if SEGMENT_NAME.fullmatch(path.name) and not _alive(sender_pid(path.name)) and _unlink_if_unheld(path):
            removed.append(path.name)
    return removed


def _unlink_if_unheld(path: Path) -> bool:
    """Unlink `path` unless a live process holds its lock (its sender, whatever its pid namespace)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # NOTE: gone already, or not ours to open
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink(missing_ok=True)
        return True
    except OSError:  # NOTE: BlockingIOError: held; PermissionError: another user's
        return False
    finally:
        os.close(fd)


def _remove_stale_logged() -> None:
    try:
        removed = remove_stale_segments()
    except OSError as exc:  # NOTE: /dev/shm unreadable here: nothing to clean, and no reason not to start
        logger.debug("no stale shared-memory segments removed: %s", exc)
        return
    if removed:
        logger.info("removed %d shared-memory segments of senders that are gone: %s", len(removed), removed)


# ---- CUDA IPC ------------------------------------------------------------------------------------


def export_cuda(buf: torch.Tensor) -> CudaIpcBuffer:
    """An IPC handle of a CUDA bucket buffer (keep `buf` alive until every receiver answered)."""
    if buf.device.type != "cuda":
        raise ValueError("CUDA IPC shares CUDA tensors only")
    storage = buf.untyped_storage()
    device, handle, size, offset, ref_handle, ref_offset, event, sync = storage._share_cuda_()
    return CudaIpcBuffer(int(device), bytes(handle), int(size), int(offset), buf.storage_offset() * buf.element_size(),
                         bytes(ref_handle), int(ref_offset), bytes(event), bool(sync))


def import_cuda(ipc: CudaIpcBuffer, nbytes: int) -> torch.Tensor:
    """The sender's bucket as a uint8 tensor on this process's view of its device (copy from it;
    drop it to release the mapping)."""
    if ipc.tensor_offset + nbytes > ipc.storage_size:
        raise ValueError(f"CUDA IPC buffer: {nbytes} bytes at {ipc.tensor_offset} overrun its storage of "
                         f"{ipc.storage_size}")
    # NOTE: as torch.multiprocessing's rebuild_cuda_tensor: the storage's offset in the block goes
    # to _new_shared_cuda, the bucket's offset in the storage is a slice
    storage = torch.UntypedStorage._new_shared_cuda(ipc.device, ipc.handle, ipc.storage_size, ipc.storage_offset,
                                                    ipc.ref_counter_handle, ipc.ref_counter_offset,
                                                    ipc.event_handle, ipc.event_sync_required)
    whole = torch.empty(0, dtype=torch.uint8, device=f"cuda:{ipc.device}").set_(storage)
    return whole[ipc.tensor_offset : ipc.tensor_offset + nbytes]
