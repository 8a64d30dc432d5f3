"""The `shm` transport, same host only: on CPU a /dev/shm segment the sender fills while the
replicas copy it (`weight_sync.transports.shm`), on GPU the sender's bucket buffers shared as CUDA
IPC handles. Either way a `SharedMemorySource` goes to every replica, which copies the buckets
into its staged update; the sender's memory is reused only once every replica answered.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

from weight_sync.buckets import as_bytes, bucket_checksum, manifest_for, pack_bucket, unpack_bucket
from weight_sync.manifest import ChecksumError, Manifest, Naming, check_against_model
from weight_sync.sources import SharedMemorySource, source_version
from weight_sync.transports import Transport
from weight_sync.transports.shm import SegmentPlan, export_cuda, fill_segment, import_cuda, read_segment


class SharedMemoryTransport:
    """`send` on the trainer (a `WeightSender`: its `regions`, `cuda_buckets`), `receive` on a
    replica (a `WeightReceiver`: its `mappings`, `host_buffer`)."""

    transports = (Transport.SHM,)
    source_type = SharedMemorySource

    def send(self, sender: Any, named: list[tuple[str, torch.Tensor]], version: Optional[int], policy: Any, *,
             tell: Optional[Callable[[Any, SharedMemorySource], Any]] = None, what: Optional[str] = None) -> int:
        """The bytes moved. `tell(target, source)`: how each target hears of the update (default
        `update(source, policy)`; an adapter sync wraps the source in its own call)."""
        manifest = manifest_for(named, bucket_bytes=sender.bucket_bytes, version=version)
        tensors = [t for _, t in named]
        tell = tell or (lambda t, s: t.update(s, policy))
        what = what or f"sync to version {version}"
        if not tensors or tensors[0].device.type != "cuda":
            return self._fill_segment(sender, manifest, tensors, tell, what)
        sender.cuda_buckets = [torch.empty(b.nbytes, dtype=torch.uint8, device=tensors[0].device)
                               for b in manifest.layout.buckets]
        for i, buf in enumerate(sender.cuda_buckets):
            manifest.layout.buckets[i].checksum = pack_bucket(manifest, i, tensors, buf)
        torch.cuda.current_stream().synchronize()
        source = SharedMemorySource(manifest=manifest, cuda_ipc=[export_cuda(b) for b in sender.cuda_buckets])
        futures = sender.each(lambda t: tell(t, source))
        sender.collect(futures, what)
        sender.cuda_buckets = []  # NOTE: every receiver answered: they copied what they needed
        return manifest.total_bytes

    @staticmethod
    def _fill_segment(sender: Any, manifest: Manifest, tensors: list[torch.Tensor],
                      tell: Callable[[Any, SharedMemorySource], Any], what: str) -> int:
        """The source goes first; the segment is filled while the replicas copy it."""
        plan = SegmentPlan.of(manifest, sender.piece_bytes)
        region = sender.regions.get(plan.segment_bytes)
        token = secrets.randbits(63) or 1
        source = SharedMemorySource(manifest=manifest, segment=region.name, token=token, piece_bytes=plan.piece_bytes)
        futures = sender.each(lambda t: tell(t, source))
        sources = [as_bytes(t).numpy() for t in tensors]
        return sender.move_then_collect(futures, what,
                                        lambda: fill_segment(region, plan, sources, token))

    def receive(self, receiver: Any, source: SharedMemorySource, policy: Any) -> int:
        """Copy the buckets in (checked, staged, committed)."""
        naming = check_against_model(source.manifest, receiver.spec)
        read = _read_segment if source.segment is not None else _read_cuda_ipc
        return receiver.staged(source_version(source), source.staging, policy, lambda: read(receiver, source, naming))


def _read_segment(receiver: Any, source: SharedMemorySource, naming: Naming) -> None:
    """Pieces straight into the engine's staging buffers where it can take them as they are,
    else into a scratch buffer that `load_weights` copies from."""
    manifest = source.manifest
    layout = manifest.layout
    plan = SegmentPlan.of(manifest, source.piece_bytes)
    direct = receiver.staging_buffers(manifest, torch.device("cpu"))
    scratch = None if len(direct) == len(manifest.names) else receiver.host_buffer.get(plan.data_bytes)
    tensors: dict[str, torch.Tensor] = {}
    for b, (bucket, at) in enumerate(zip(layout.buckets, layout.region_offsets())):
        tensors.update(unpack_bucket(manifest, b, None if scratch is None else scratch[at : at + bucket.nbytes],
                                     direct))
    destinations = [as_bytes(tensors[name]).numpy() for name in manifest.names]

    def load(b: int) -> None:
        bucket = layout.buckets[b]
        receiver.load({n: tensors[n] for n in manifest.names[bucket.start : bucket.stop]}, naming)
        receiver.stats.bytes_received += bucket.nbytes

    read_segment(receiver.mappings, source.segment, plan, source.token, destinations, receiver.timeout_s, load)


def cuda_ipc_buckets(source: SharedMemorySource) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
    """A GPU trainer's buckets behind its CUDA IPC handles, each checksummed, as (its tensors, its
    bytes). The tensors are views of the mapping: the caller copies them before the next bucket."""
    manifest = source.manifest
    for index, bucket in enumerate(manifest.layout.buckets):
        view = import_cuda(source.cuda_ipc[index], bucket.nbytes)
        checksum = bucket_checksum(view, bucket)
        if checksum != bucket.checksum:
            raise ChecksumError(f"bucket {index} of {manifest.num_buckets} ({bucket.nbytes} bytes): checksum "
                                f"{checksum:#x}, the manifest says {bucket.checksum:#x}")
        yield unpack_bucket(manifest, index, view), bucket.nbytes
        del view  # NOTE: the caller copied every byte; the mapping goes with the last view


def _read_cuda_ipc(receiver: Any, source: SharedMemorySource, naming: Naming) -> None:
    for named, nbytes in cuda_ipc_buckets(source):
        receiver.load(named, naming)
        receiver.stats.bytes_received += nbytes
