"""A safetensors directory: weights between separate jobs, or kept as checkpoints.

`write_checkpoint` writes one safetensors file per bucket, the HF index
(`model.safetensors.index.json`, so the directory loads anywhere HF checkpoints do) and the
manifest (`weight_sync_manifest.json`: names, shapes, dtypes, buckets with their checksums, the
version). It writes into a hidden temporary directory and renames it into place at the end, so a
reader never sees half a checkpoint. `read_bucket` reads one bucket's file back; a receiver checks
the manifest against its model first, then each file against its checksum as it reads it. A
directory without the manifest (any HF checkpoint) is read whole, unchecked. A replica reads
every file through `checkpoint_files.CheckpointDir`: regular files inside the directory only,
within its `--weights-root` directories, off its socket thread and engine loop, by its timeout.
`DiskTransport` is the `disk` transport: a sender writes such a directory per version, a replica
reads it.
"""

from __future__ import annotations

import json
import secrets
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import msgspec
import torch

from weight_sync.buckets import DEFAULT_BUCKET_BYTES, fill_checksums, manifest_for, tensor_checksum
from weight_sync.manifest import ChecksumError, Manifest, ManifestError, check_against_model, dtype_name
from weight_sync.sources import DiskSource
from weight_sync.transports import Transport
from weight_sync.transports.checkpoint_files import INDEX_FILE, CheckpointDir, CheckpointError

MANIFEST_FILE = "weight_sync_manifest.json"


def bucket_file(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_checkpoint(directory: str | Path, named: Sequence[tuple[str, torch.Tensor]], *, version: Optional[int],
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Manifest:
    """Write `named` to `directory` (replaced if it exists) as described in the module docstring."""
    from safetensors.torch import save_file

    directory = Path(directory)
    tensors = [t.detach().contiguous().cpu() for _, t in named]
    manifest = manifest_for(list(zip([n for n, _ in named], tensors)), bucket_bytes=bucket_bytes, version=version)
    fill_checksums(manifest, tensors)
    buckets = manifest.layout.buckets
    tmp = directory.parent / f".{directory.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir(parents=True)
    try:
        weight_map = {}
        for i, b in enumerate(buckets):
            name = bucket_file(i, len(buckets))
            save_file({manifest.names[t]: tensors[t] for t in range(b.start, b.stop)}, str(tmp / name))
            weight_map.update({manifest.names[t]: name for t in range(b.start, b.stop)})
        index = {"metadata": {"total_size": sum(manifest.tensor_bytes())}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1))
        (tmp / MANIFEST_FILE).write_bytes(msgspec.json.encode(manifest))
        if directory.exists():
            shutil.rmtree(directory)
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def read_manifest(directory: CheckpointDir) -> Optional[Manifest]:
    """The directory's manifest, or None for a plain HF checkpoint."""
    raw = directory.read_json(MANIFEST_FILE)
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=Manifest)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ManifestError(f"{directory.path}/{MANIFEST_FILE}: {exc}") from None


def read_bucket(directory: CheckpointDir, manifest: Manifest, index: int,
                buffer: Optional[Callable[[int], torch.Tensor]] = None,
                direct: Optional[Mapping[str, torch.Tensor]] = None) -> tuple[dict[str, torch.Tensor], int]:
    """Bucket `index`'s tensors from its file (read into `direct`'s buffers, or `buffer`'s: see
    `SafetensorsFile.read`), and their checksum (compare with the manifest's).
    `CheckpointError` for a missing or unreadable file, `ManifestError` for a tensor it lacks or mis-shapes."""
    buckets = manifest.layout.buckets
    name = bucket_file(index, len(buckets))
    found = directory.read_tensors(name, buffer, direct)
    if found is None:
        raise CheckpointError(f"bucket {index} of {len(buckets)} is missing: {directory.path}/{name}")
    b = buckets[index]
    out, total = {}, 0
    for t in range(b.start, b.stop):
        tensor = found.get(manifest.names[t])
        if tensor is None:
            raise ManifestError(f"{name} lacks {manifest.names[t]}")
        if list(tensor.shape) != manifest.shapes[t] or tensor.dtype != manifest.torch_dtypes[t]:
            raise ManifestError(f"{name}: {manifest.names[t]} is {tensor.dtype} {list(tensor.shape)}, the manifest "
                                f"says {manifest.dtypes[t]} {manifest.shapes[t]}")
        out[manifest.names[t]] = tensor
        total += tensor_checksum(tensor)
    return out, total % 2**64


# ---- the transport: both sides of one update -----------------------------------------------------


class DiskTransport:
    """`send` writes a version's directory under the sender's `directory` (deleting the oldest
    beyond `keep_last`, once every replica committed a newer one) and names it to every replica
    (a `DiskSource`); `receive` loads one bucket file at a time against its checksum."""

    transports = (Transport.DISK,)
    source_type = DiskSource

    def send(self, sender: Any, named: list[tuple[str, torch.Tensor]], version: int, policy: Any) -> int:
        path = sender.directory / f"v{version:08d}"
        manifest = write_checkpoint(path, named, version=version, bucket_bytes=sender.bucket_bytes)
        source = DiskSource(path=str(path.absolute()))  # NOTE: its version is in the manifest it holds
        futures = sender.each(lambda t: t.update(source, policy))
        sender.collect(futures, f"sync to version {version}")
        if path not in sender.written:
            sender.written.append(path)
        while sender.keep_last is not None and len(sender.written) > sender.keep_last:
            shutil.rmtree(sender.written.pop(0), ignore_errors=True)  # NOTE: every replica committed a newer one
        return manifest.total_bytes

    def receive(self, receiver: Any, source: DiskSource, policy: Any) -> int:
        """Bucket by bucket against the directory's manifest if it has one, else whole (any HF
        checkpoint, unchecked); only where the receiver's `disk_access` allows, by its timeout."""
        with CheckpointDir(source.path, receiver.disk_access, receiver.timeout_s) as directory:
            return self._receive(receiver, directory, source.version, policy)

    @staticmethod
    def _receive(receiver: Any, directory: CheckpointDir, version: Optional[int], policy: Any) -> int:
        manifest = read_manifest(directory)
        if manifest is None:
            return _receive_plain(receiver, directory, version, policy)
        if version is not None and manifest.version is not None and version != manifest.version:
            raise ManifestError(f"{directory.path}: the source says version {version}, the directory's manifest "
                                f"{manifest.version}")
        naming = check_against_model(manifest, receiver.spec)

        def load() -> None:
            direct = receiver.staging_buffers(manifest, torch.device("cpu"))
            for index, bucket in enumerate(manifest.layout.buckets):
                # NOTE: one warm scratch buffer for every bucket: `load` copies a bucket out before the next is read
                tensors, checksum = read_bucket(directory, manifest, index, receiver.host_buffer.get, direct)
                if checksum != bucket.checksum:
                    raise ChecksumError(f"{bucket_file(index, manifest.num_buckets)}: checksum {checksum:#x}, the "
                                        f"manifest says {bucket.checksum:#x}")
                receiver.load(tensors, naming)
                receiver.stats.bytes_received += bucket.nbytes

        return receiver.staged(manifest.version if version is None else version, None, policy, load)


def _receive_plain(receiver: Any, directory: CheckpointDir, version: Optional[int], policy: Any) -> int:
    """A checkpoint without a manifest: its files' headers checked against the model, then each
    file read and loaded in turn (unchecked: there are no checksums)."""
    headers = directory.headers()
    entries = {name: entry for file in headers.values() for name, entry in file.items()}
    manifest = Manifest(names=list(entries), dtypes=[dtype_name(e.torch_dtype) for e in entries.values()],
                        shapes=[e.shape for e in entries.values()])
    naming = check_against_model(manifest, receiver.spec)

    def load() -> None:
        direct = receiver.staging_buffers(manifest, torch.device("cpu"))
        for file in headers:
            tensors = directory.read_tensors(file, receiver.host_buffer.get, direct)
            if tensors is None:
                raise CheckpointError(f"{directory.path}: {file} is missing")
            receiver.load(tensors, naming)

    return receiver.staged(version, None, policy, load)
