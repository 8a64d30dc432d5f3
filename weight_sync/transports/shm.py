"""Shared memory on one host: CPU buckets in a /dev/shm segment, GPU buckets as CUDA IPC handles.

The sender packs every bucket, back to back, into a `SharedRegion` (a file under /dev/shm mapped
into its memory, kept and reused across syncs while it is large enough, so its pages stay warm),
then sends one `SharedMemorySource` naming the segment and carrying the manifest. A receiver maps
the segment privately (`open_segment`), checks each bucket's checksum and hands views of it to the
engine's `load_weights`, which copies them into memory the engine owns; the mapping is closed at
the end, so no receiver keeps the sender's pages. The sender reuses the region only after every
receiver answered.

On GPU the buckets stay in the sender's device memory and travel as CUDA IPC handles
(`CudaIpcBuffer`, the fields of `torch.UntypedStorage._share_cuda_()`), opened by the receiver
with `_new_shared_cuda` and copied the same way. The handle is plain msgpack, never pickle.

Segment names are `rollout-wsync-<pid>-<random>`; a receiver opens nothing else. A sender killed
before it unlinks its segment leaves it behind: `remove_stale_segments()` removes those whose
process is gone.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from pathlib import Path
from typing import Annotated, Optional

import msgspec
import torch
from msgspec import Meta

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "rollout-wsync-"
_SEGMENT = re.compile(rf"{SEGMENT_PREFIX}(\d+)-[0-9a-f]{{8,32}}")


class CudaIpcBuffer(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One bucket's device memory: what `torch.UntypedStorage._share_cuda_()` says of its storage
    (`handle` names the allocator's whole block, `storage_offset` is where the storage starts in
    it, in bytes), and `tensor_offset`, where the bucket starts in the storage, in bytes."""

    device: Annotated[int, Meta(ge=0)]
    handle: bytes
    storage_size: Annotated[int, Meta(ge=0)]
    storage_offset: Annotated[int, Meta(ge=0)]
    tensor_offset: Annotated[int, Meta(ge=0)]
    ref_counter_handle: bytes
    ref_counter_offset: Annotated[int, Meta(ge=0)]
    event_handle: bytes
    event_sync_required: bool


def check_segment_name(name: str) -> str:
    if not _SEGMENT.fullmatch(name):
        raise ValueError(f"shared-memory segment {name!r} is not one of ours ({SEGMENT_PREFIX}<pid>-<hex>)")
    return name


class SharedRegion:
    """The sender's segment (see module docstring); `tensor` is its bytes, writable."""

    def __init__(self, nbytes: int) -> None:
        self.name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.path = SHM_DIR / self.name
        self.nbytes = nbytes
        storage = torch.UntypedStorage.from_file(str(self.path), shared=True, nbytes=max(1, nbytes))
        self.tensor = torch.empty(0, dtype=torch.uint8).set_(storage)

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def __del__(self) -> None:
        try:
            self.path.unlink()
        except (FileNotFoundError, AttributeError, TypeError):
            pass


class RegionPool:
    """The sender's one region, grown when a sync needs more (the old one is unlinked)."""

    def __init__(self) -> None:
        self.region: Optional[SharedRegion] = None

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


def open_segment(name: str, nbytes: int) -> torch.Tensor:
    """A receiver's private, read-as-shared mapping of the sender's segment (`nbytes` of it).
    Drop the tensor (and every view of it) to unmap."""
    path = SHM_DIR / check_segment_name(name)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"shared-memory segment {name} is gone (the sender exited?)") from None
    if size < nbytes:
        raise ValueError(f"shared-memory segment {name} holds {size} bytes, the manifest needs {nbytes}")
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=max(1, nbytes))
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def remove_stale_segments() -> list[str]:
    """Unlink segments whose sender process no longer exists; their names."""
    removed = []
    for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}*"):
        m = _SEGMENT.fullmatch(path.name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(path.name)
        except PermissionError:
            continue
    return removed


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
