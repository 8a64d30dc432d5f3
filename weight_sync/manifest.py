"""The manifest of a weight update: what will arrive and how to check it, before a byte moves.

A sender describes an update once, up front: every tensor's name, dtype and shape (SGLang's
`names` / `dtypes` / `shapes`), how the tensors are packed into buckets (each tensor's byte offset
in its bucket, each bucket's size and checksum), the total bytes and the target version. A receiver
checks the manifest against its model (`check_against_model`) before it accepts a byte, so a
manifest for another model (an unknown name, a wrong shape, a missing tensor) is refused then.

Packing (`weight_sync.buckets`). Tensors fill buckets in manifest order: a bucket holds the
consecutive tensors `[start, stop)`, each at an offset aligned to `ALIGN` bytes, the gaps zero; a
bucket closes when the next tensor would take it past the bucket size, and a tensor larger than
that gets a bucket of its own. `layout` None means no packing: each tensor travels on its own, in
order (SGLang's tensor-by-tensor broadcast, kept for compatibility and as the benchmark's contrast).

Checksum. A bucket's checksum is the sum, modulo 2**64, of its bytes read as little-endian 64-bit
words: one read pass at memory speed, and a sum of per-tensor sums (each tensor's last word
zero-padded), so a sender can compute it before packing and a checkpoint per file. It catches
flipped, lost or truncated bytes; it is not a cryptographic hash, and two swapped words pass.

Versions are integers on our side. Peers that spell them as strings (SGLang's `weight_version`)
are mapped by `parse_weight_version` ("7", "v7", "step_7" -> 7) and answered `str(version)`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Annotated, Any, Optional, Union

import msgspec
import torch
from msgspec import Meta

from inference.bounded import NonNegInt
from inference.errors import WeightNameError, WeightShapeError
from inference.models.spec import ModelSpec
from weight_sync.megatron.names import LM_HEAD, Naming, detect_naming, validate_megatron

ALIGN = 64  # byte alignment of each tensor in a bucket (a multiple of every dtype's size and of 8)
MAX_TENSORS = 1 << 20
MAX_NAME = 1024
MAX_DIMS = 8

Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
Shape = Annotated[list[NonNegInt], Meta(max_length=MAX_DIMS)]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ManifestError(ValueError):
    """A manifest that contradicts itself or its model (names the field)."""


class ChecksumError(ValueError):
    """Bytes that arrived do not sum to the checksum their sender computed: the update aborts."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ManifestError(f"dtype {dtype} cannot travel as a weight (one of {sorted(DTYPES)})") from None


def parse_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` or SGLang's `"torch.bfloat16"`."""
    key = name[len("torch."):] if name.startswith("torch.") else name
    try:
        return DTYPES[key]
    except KeyError:
        raise ManifestError(f"dtypes: {name!r} is not one of {sorted(DTYPES)}") from None


def tensor_nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


_VERSION = re.compile(r"(?:[A-Za-z][A-Za-z_]*?[_\-]?)?(\d{1,18})")


def parse_weight_version(value: Union[str, int, None]) -> Optional[int]:
    """A peer's weight version as ours: an int as is, a string of digits with an optional word
    prefix (`"7"`, `"v7"`, `"step_7"`) as that number, None as None; anything else refused."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ManifestError(f"weight_version: expected an integer or a string naming one, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ManifestError(f"weight_version must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _VERSION.fullmatch(value.strip())
        if m is not None:
            return int(m.group(1))
    raise ManifestError(f"weight_version {value!r}: versions are integers here; give one as a number "
                        "or a string like '7', 'v7' or 'step_7'")


class Bucket(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Tensors `[start, stop)` of the manifest, packed into `nbytes` (a multiple of ALIGN)."""

    start: NonNegInt
    stop: NonNegInt
    nbytes: NonNegInt
    checksum: int = 0  # NOTE: uint64; msgspec bounds only reach int64, so checked below

    def __post_init__(self) -> None:
        if not 0 <= self.checksum < 2**64:
            raise ManifestError(f"bucket checksum {self.checksum} is not a 64-bit unsigned integer")


class Layout(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How the tensors are packed: each tensor's byte offset in its bucket, and the buckets in order."""

    offsets: Annotated[list[NonNegInt], Meta(max_length=MAX_TENSORS)]
    buckets: Annotated[list[Bucket], Meta(max_length=MAX_TENSORS)]

    def region_offsets(self) -> list[int]:
        """Where each bucket starts when the buckets lie back to back (shared memory)."""
        out, at = [], 0
        for b in self.buckets:
            out.append(at)
            at += b.nbytes
        return out


class Manifest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One update's description (see module docstring). Consistency is checked at construction
    and at decode; agreement with a model by `check_against_model`."""

    names: Annotated[list[Name], Meta(max_length=MAX_TENSORS)]
    dtypes: Annotated[list[str], Meta(max_length=MAX_TENSORS)]
    shapes: Annotated[list[Shape], Meta(max_length=MAX_TENSORS)]
    layout: Optional[Layout] = None
    version: Optional[NonNegInt] = None
    total_bytes: NonNegInt = 0

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtypes) != n or len(self.shapes) != n:
            raise ManifestError(f"manifest: {n} names, {len(self.dtypes)} dtypes, {len(self.shapes)} shapes")
        if len(set(self.names)) != n:
            raise ManifestError("manifest: a tensor name appears twice")
        dtypes = [parse_dtype(d) for d in self.dtypes]
        sizes = [tensor_nbytes(d, s) for d, s in zip(dtypes, self.shapes)]
        if self.layout is None:
            if self.total_bytes not in (0, sum(sizes)):
                raise ManifestError(f"manifest: total_bytes {self.total_bytes} != the tensors' {sum(sizes)}")
            self.total_bytes = sum(sizes)
            return
        _check_layout(self.layout, sizes)
        total = sum(b.nbytes for b in self.layout.buckets)
        if self.total_bytes not in (0, total):
            raise ManifestError(f"manifest: total_bytes {self.total_bytes} != the buckets' {total}")
        self.total_bytes = total

    @property
    def torch_dtypes(self) -> list[torch.dtype]:
        return [parse_dtype(d) for d in self.dtypes]

    def tensor_bytes(self) -> list[int]:
        return [tensor_nbytes(d, s) for d, s in zip(self.torch_dtypes, self.shapes)]

    @property
    def num_buckets(self) -> int:
        return len(self.names) if self.layout is None else len(self.layout.buckets)


def _check_layout(layout: Layout, sizes: list[int]) -> None:
    n = len(sizes)
    if len(layout.offsets) != n:
        raise ManifestError(f"layout.offsets: {len(layout.offsets)} offsets for {n} tensors")
    expect = 0
    for i, b in enumerate(layout.buckets):
        if b.start != expect or not b.start < b.stop <= n:
            raise ManifestError(f"layout.buckets[{i}]: tensors [{b.start}, {b.stop}) do not follow the previous "
                                f"bucket (which ended at {expect}) within {n} tensors")
        if b.nbytes % ALIGN:
            raise ManifestError(f"layout.buckets[{i}].nbytes {b.nbytes} is not a multiple of {ALIGN}")
        end = 0
        for t in range(b.start, b.stop):
            off = layout.offsets[t]
            if off % ALIGN or off < end:
                raise ManifestError(f"layout.offsets[{t}] = {off}: not {ALIGN}-aligned or overlapping the tensor "
                                    f"before it (which ends at {end})")
            end = off + sizes[t]
        if end > b.nbytes:
            raise ManifestError(f"layout.buckets[{i}]: its tensors end at byte {end}, past its nbytes {b.nbytes}")
        expect = b.stop
    if expect != n:
        raise ManifestError(f"layout.buckets cover {expect} of the {n} tensors")


def check_against_model(manifest: Manifest, spec: ModelSpec, *, complete: bool = True) -> Naming:
    """Refuse a manifest for another model: names (HF or megatron-core), shapes, floating dtypes,
    and with `complete` every tensor present. `WeightNameError` / `WeightShapeError` name the
    first problems; nothing is received before this passes. Returns the naming."""
    names = list(manifest.names)
    if not names:
        raise WeightNameError("the manifest names no tensor")
    naming = detect_naming(names)
    fakes = {n: torch.empty(s, dtype=d, device="meta")
             for n, d, s in zip(names, manifest.torch_dtypes, manifest.shapes)}
    if naming is Naming.MEGATRON:
        validate_megatron(fakes, spec, complete=complete)
        return naming
    expected = spec.weight_shapes()
    unknown = [n for n in names if n not in expected and not (n == LM_HEAD and spec.tie_word_embeddings)]
    if unknown:
        raise WeightNameError(f"the manifest is for another model: unknown tensors {unknown[:8]}")
    wrong = [f"{n}: {tuple(t.shape)} != {expected[n]}" for n, t in fakes.items()
             if n in expected and tuple(t.shape) != expected[n]]
    if wrong:
        raise WeightShapeError(f"the manifest is for another model: {'; '.join(wrong[:8])}")
    missing = [n for n in expected if n not in fakes]
    if complete and missing:
        raise WeightNameError(f"the manifest lacks {len(missing)} of the model's tensors, e.g. {missing[:8]} "
                              "(a partial update says so)")
    return naming


_MANIFEST_DECODER = msgspec.msgpack.Decoder(Manifest)  # NOTE: built at import, not by racing threads


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.msgpack.encode(manifest)


def decode_manifest(data: bytes) -> Manifest:
    try:
        return _MANIFEST_DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise ManifestError(f"manifest: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ManifestError(f"manifest: not msgpack: {exc}") from None


def describe(manifest: Manifest) -> dict[str, Any]:
    """A few figures for logs and replies."""
    return {"tensors": len(manifest.names), "buckets": manifest.num_buckets, "bytes": manifest.total_bytes,
            "version": manifest.version}
