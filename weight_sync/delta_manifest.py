"""The manifest of a delta update: what changed since the replica's base, and how to prove the result.

A delta describes the same full set of tensors as a full update (names, dtypes, shapes, in one
order, which is the hash's order), each with its `TensorChange`: how its change since the base is
encoded (`Encoding`) and where those bytes lie in the update's one flat `payload`. It says which
version it applies to (`base_version`), which it commits under (`version`), and the
order-sensitive hash of the full weights that result (`weights_hash`, see
`weight_sync.weights_hash`): a replica commits only if its own result hashes the same, so a wrong
base or a lost or corrupted piece can never commit.

The payload travels over the transports' bucket machinery as one opaque tensor of 8-byte words
(`carrier`), so it gets their pieces, pipelining and checksums unchanged (`payload_checksum` is
its word sum, the carrier bucket's checksum).

A delta whose `base_version` is None applies onto any weights: every change is FULL. It is what
a replica that needs a full sync gets while the others of its weight group take the delta: both
manifests describe one shared payload (the delta's changes, then every tensor's bytes), so one
broadcast or one segment serves both, each replica reading its own manifest.
"""

from __future__ import annotations

import enum
import math
from typing import Annotated, Optional

import msgspec
from msgspec import Meta

from weight_sync.manifest import (
    ALIGN,
    MAX_TENSORS,
    Bucket,
    Layout,
    Manifest,
    ManifestError,
    Name,
    NonNegInt,
    Shape,
    parse_dtype,
)
from weight_sync.weights_hash import HASH_BYTES

PAYLOAD_NAME = "delta.payload"  # the carrier's one tensor: not a weight, never loaded as one
INDEX_BYTES = 4  # a sparse change's index: uint32 (tensors of more than 2**32 elements are sent dense)
MAX_SPARSE_ELEMENTS = 2**32


class DeltaError(ValueError):
    """A delta that cannot apply here (a wrong base, bytes that do not decode, a result whose hash
    differs from the trainer's): the update aborts, the old weights keep serving, and the sender
    sends a full update next."""


class BaseMismatchError(DeltaError):
    """The replica's weights are not the delta's base (it restarted, missed an update or joined
    late): refused before a byte moves; it needs a full sync."""


class Encoding(enum.IntEnum):
    """How one tensor's change travels (the encoder picks the smallest, `weight_sync.delta_codec`)."""

    UNCHANGED = 0  # bitwise equal to the base: no bytes
    SPARSE = 1  # `count` uint32 indices, then `count` new values, in element order
    XOR_ZSTD = 2  # one zstd frame of the new bits XOR the base's, every element
    FULL = 3  # the new tensor's bytes as they are (nothing smaller)


class TensorChange(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One tensor's change: `nbytes` of the payload at `offset` (8-aligned); `count` elements differ."""

    encoding: Encoding
    count: NonNegInt
    offset: NonNegInt
    nbytes: NonNegInt


class DeltaManifest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One delta update (see module docstring); consistency checked at construction and decode."""

    names: Annotated[list[Name], Meta(max_length=MAX_TENSORS)]
    dtypes: Annotated[list[str], Meta(max_length=MAX_TENSORS)]
    shapes: Annotated[list[Shape], Meta(max_length=MAX_TENSORS)]
    changes: Annotated[list[TensorChange], Meta(max_length=MAX_TENSORS)]
    base_version: Optional[NonNegInt]  # None: onto any weights (every change FULL)
    version: NonNegInt
    weights_hash: Annotated[bytes, Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]
    payload_bytes: Annotated[int, Meta(ge=ALIGN, multiple_of=ALIGN)]
    payload_checksum: int = 0  # NOTE: uint64, checked below (msgspec bounds reach int64 only)

    def __post_init__(self) -> None:
        n = len(self.names)
        if not (len(self.dtypes) == len(self.shapes) == len(self.changes) == n):
            raise ManifestError(f"delta: {n} names, {len(self.dtypes)} dtypes, {len(self.shapes)} shapes, "
                                f"{len(self.changes)} changes")
        if len(set(self.names)) != n:
            raise ManifestError("delta: a tensor name appears twice")
        if self.base_version is not None and self.version <= self.base_version:
            raise ManifestError(f"delta: version {self.version} does not follow its base {self.base_version}")
        if self.base_version is None and any(c.encoding is not Encoding.FULL for c in self.changes):
            raise ManifestError("delta: without a base version every change must be FULL")
        if not 0 <= self.payload_checksum < 2**64:
            raise ManifestError(f"delta: payload_checksum {self.payload_checksum} is not a 64-bit unsigned integer")
        for i, (dtype, shape, change) in enumerate(zip(self.dtypes, self.shapes, self.changes)):
            _check_change(i, change, math.prod(shape), _item_size(parse_dtype(dtype)), self.payload_bytes)

    def model_manifest(self) -> Manifest:
        """The full update this delta stands for (what a replica checks against its model)."""
        return Manifest(names=self.names, dtypes=self.dtypes, shapes=self.shapes, version=self.version)

    def carrier(self) -> Manifest:
        """The payload as the transports move it: one tensor of 8-byte words in one bucket."""
        bucket = Bucket(0, 1, self.payload_bytes, self.payload_checksum)
        return Manifest(names=[PAYLOAD_NAME], dtypes=["float64"], shapes=[[self.payload_bytes // 8]],
                        layout=Layout(offsets=[0], buckets=[bucket]), version=self.version)

    @property
    def changed(self) -> list[int]:
        """Indices of the tensors that differ from the base."""
        return [i for i, c in enumerate(self.changes) if c.encoding is not Encoding.UNCHANGED]


def _item_size(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _check_change(i: int, change: TensorChange, numel: int, item: int, payload_bytes: int) -> None:
    where = f"delta.changes[{i}]"
    if change.offset % 8 or change.offset + change.nbytes > payload_bytes:
        raise ManifestError(f"{where}: bytes [{change.offset}, {change.offset + change.nbytes}) are not 8-aligned "
                            f"or overrun the payload of {payload_bytes}")
    if not change.count <= numel:
        raise ManifestError(f"{where}: {change.count} changed elements of a tensor of {numel}")
    expected = {Encoding.UNCHANGED: 0, Encoding.SPARSE: change.count * (INDEX_BYTES + item),
                Encoding.FULL: numel * item}.get(change.encoding)
    if expected is not None and change.nbytes != expected:
        raise ManifestError(f"{where}: {change.encoding.name} takes {expected} bytes, the manifest says "
                            f"{change.nbytes}")
    if change.encoding is Encoding.UNCHANGED and change.count:
        raise ManifestError(f"{where}: UNCHANGED with {change.count} changed elements")
    if change.encoding is Encoding.SPARSE and numel > MAX_SPARSE_ELEMENTS:
        raise ManifestError(f"{where}: SPARSE indices are uint32; a tensor of {numel} elements is sent dense")
    if change.encoding is Encoding.XOR_ZSTD and not change.nbytes:
        raise ManifestError(f"{where}: XOR_ZSTD with no bytes")


__all__ = ["BaseMismatchError", "DeltaError", "DeltaManifest", "Encoding", "PAYLOAD_NAME", "TensorChange"]
