"""One safetensors file read from a descriptor: its header checked, its tensors read with
`readinto` in chunks (which release the GIL) against a deadline.

The format: 8 bytes (little-endian) of header length, a JSON header naming each tensor's dtype,
shape and `data_offsets` (relative to the data after the header), then the data. Here the header
is checked before a byte of data is read: JSON, known dtypes, offsets inside the file and the
size each shape and dtype needs; anything else is a `CheckpointError` (the request's fault).

Reading puts each tensor's bytes where the caller wants them: straight into a buffer the engine
handed out for that name (`direct`, the same dtype and shape: no copy after the read), else into
a scratch buffer (`buffer(nbytes)`, a warm one reused from file to file: three times faster to
fill than fresh memory).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Optional

import msgspec
import torch
from msgspec import Meta

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own bound on a header
CHUNK_BYTES = 16 * 2**20  # one readinto: the deadline is checked between chunks
DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A disk update's path is refused, or a file in it is not what it should be."""


class TensorEntry(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: list[Annotated[int, Meta(ge=0)]]
    data_offsets: tuple[Annotated[int, Meta(ge=0)], Annotated[int, Meta(ge=0)]]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class SafetensorsFile:
    """The open regular file `fd` (owned: `close` closes it) named `what` in messages; `entries`
    is its checked header, in the order of its data."""

    def __init__(self, fd: int, what: str, deadline: float) -> None:
        self.file = os.fdopen(fd, "rb", buffering=0)
        self.what, self.deadline = what, deadline
        try:
            self.entries, self.data_start, self.data_bytes = self._header()
        except BaseException:
            self.file.close()
            raise

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()

    def _header(self) -> tuple[dict[str, TensorEntry], int, int]:
        size = os.fstat(self.file.fileno()).st_size
        if size < 8:
            raise CheckpointError(f"{self.what}: not a safetensors file ({size} bytes)")
        head = bytearray(8)
        self._read_into(memoryview(head))
        header_bytes = int.from_bytes(head, "little")
        if header_bytes > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{self.what}: not a safetensors file (a header of {header_bytes} bytes in a file "
                                  f"of {size})")
        header = bytearray(header_bytes)
        self._read_into(memoryview(header))
        data_bytes = size - 8 - header_bytes
        entries = _parse_header(bytes(header), data_bytes, self.what)
        return dict(sorted(entries.items(), key=lambda kv: kv[1].data_offsets)), 8 + header_bytes, data_bytes

    def read(self, buffer: Optional[Callable[[int], torch.Tensor]] = None,
             direct: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """Every tensor: `direct[name]` itself, filled, where it has the entry's dtype and shape (and
        is contiguous on CPU), else a view of `buffer(data_bytes)` (None: new memory), valid until
        that buffer is used again; `TimeoutError` past the deadline."""
        scratch = None
        out: dict[str, torch.Tensor] = {}
        for key, entry in self.entries.items():
            start, end = entry.data_offsets
            target = direct.get(key) if direct else None
            if not _fits(target, entry):
                if scratch is None:
                    scratch = torch.empty(self.data_bytes, dtype=torch.uint8) if buffer is None else buffer(
                        self.data_bytes)[: self.data_bytes]
                target = _view(scratch, entry)
            self.file.seek(self.data_start + start)
            if end > start:
                self._read_into(memoryview(target.reshape(-1).view(torch.uint8).numpy()))
            out[key] = target
        return out

    def _read_into(self, view: memoryview) -> None:
        read_into(self.file, view, self.deadline, self.what)


def read_into(file: Any, view: memoryview, deadline: float, what: str) -> None:
    """Fill `view` from `file`, a chunk per `readinto` (which releases the GIL), by `deadline`
    (monotonic; `TimeoutError` past it)."""
    at = 0
    while at < len(view):
        got = file.readinto(view[at : at + CHUNK_BYTES])
        if not got:
            raise CheckpointError(f"{what}: the file ended early (it changed while read?)")
        at += got
        if at < len(view) and time.monotonic() > deadline:
            raise TimeoutError(f"{what}: reading took longer than the update's timeout")


def _parse_header(raw: bytes, data_bytes: int, what: str) -> dict[str, TensorEntry]:
    try:
        header = msgspec.json.decode(raw)
        if not isinstance(header, dict):
            raise msgspec.ValidationError("the header is not a JSON object")
        header.pop("__metadata__", None)
        entries = msgspec.convert(header, dict[str, TensorEntry])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise CheckpointError(f"{what}: not a safetensors file (its header: {exc})") from None
    for key, entry in entries.items():
        dtype = DTYPES.get(entry.dtype)
        if dtype is None:
            raise CheckpointError(f"{what}: {key} has dtype {entry.dtype!r}, not one this reader knows")
        start, end = entry.data_offsets
        nbytes = math.prod(entry.shape) * dtype.itemsize
        if not start <= end <= data_bytes or end - start != nbytes:
            raise CheckpointError(f"{what}: {key}'s bytes [{start}, {end}) do not hold {entry.dtype} "
                                  f"{entry.shape} within the file's {data_bytes} data bytes")
    return entries


def _fits(target: Optional[torch.Tensor], entry: TensorEntry) -> bool:
    return (target is not None and target.device.type == "cpu" and target.dtype == entry.torch_dtype
            and list(target.shape) == entry.shape and target.is_contiguous())


def _view(data: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    start, end = entry.data_offsets
    dtype = entry.torch_dtype
    if start % dtype.itemsize:  # NOTE: a view of another dtype must start at a multiple of its size
        return torch.empty(entry.shape, dtype=dtype)
    return data[start:end].view(dtype).reshape(entry.shape)
