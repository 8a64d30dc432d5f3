"""Packed numeric arrays for the wire protocol: token ids, log-probs and versions as raw bytes.

A packed array travels as one msgpack `bin` value holding little-endian int32 or float32 items
(4 bytes each): a quarter of a msgpack array of ints at most, and decoded without a per-item loop.
In a message it is a 1-D numpy array (`INT32` or `FLOAT32`); a decoded one is a read-only view of
the received bytes (no copy).

msgspec sees these fields as the custom type `np.ndarray`: `enc_hook` writes an array's bytes,
`dec_hook` hands the raw bytes to the owning struct's `__post_init__`, which reinterprets them with
the field's dtype (`as_int32` / `as_float32`), so a length that is not a multiple of 4 is refused
there, naming the field. Every check raises `ValueError` (msgspec reports it as a validation error).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["FLOAT32", "INT32", "as_float32", "as_int32", "check_non_negative", "check_same_length",
           "dec_hook", "enc_hook"]

INT32 = np.dtype("<i4")
FLOAT32 = np.dtype("<f4")
_INT32_INFO = np.iinfo(np.int32)


class _WireBytes(np.ndarray):
    """Raw uint8 bytes of a packed field, between msgspec's `dec_hook` and the struct's `__post_init__`.

    NOTE: msgspec insists that `dec_hook` returns the annotated type (`np.ndarray`) but does not
    say which field it decodes; this marker subclass tells `__post_init__` "reinterpret me", so
    a caller's own uint8 array is never mistaken for wire bytes.
    """


def dec_hook(tp: type, obj: Any) -> Any:
    """msgspec decode hook: a packed field's msgpack `bin` becomes a `_WireBytes` array."""
    if tp is np.ndarray and isinstance(obj, (bytes, bytearray, memoryview)):
        return np.frombuffer(obj, dtype=np.uint8).view(_WireBytes)
    raise TypeError(f"expected packed bytes (msgpack bin), got {type(obj).__name__}")


def enc_hook(obj: Any) -> Any:
    """msgspec encode hook: a packed field's array becomes its little-endian bytes."""
    if isinstance(obj, np.ndarray) and obj.dtype in (INT32, FLOAT32) and obj.ndim == 1:
        return obj.tobytes()
    raise NotImplementedError(f"cannot encode {type(obj).__name__} {getattr(obj, 'dtype', '')}")


def _from_wire(name: str, value: _WireBytes, dtype: np.dtype) -> np.ndarray:
    if value.nbytes % dtype.itemsize:
        raise ValueError(f"{name}: packed length of {value.nbytes} bytes is not a multiple of {dtype.itemsize}")
    return value.view(np.ndarray).view(dtype)


def as_int32(name: str, value: Any) -> np.ndarray:
    """`value` (wire bytes, a sequence or an array of ints) as a 1-D little-endian int32 array."""
    if type(value) is _WireBytes:
        return _from_wire(name, value, INT32)
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of ints, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=INT32)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name}: expected ints, got dtype {arr.dtype}")
    if arr.min() < _INT32_INFO.min or arr.max() > _INT32_INFO.max:
        raise ValueError(f"{name}: values must fit in int32")
    return arr.astype(INT32, copy=False)


def as_float32(name: str, value: Any) -> np.ndarray:
    """`value` (wire bytes, a sequence or an array of numbers) as a 1-D little-endian float32 array."""
    if type(value) is _WireBytes:
        return _from_wire(name, value, FLOAT32)
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of numbers, got shape {arr.shape}")
    if arr.size and not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"{name}: expected numbers, got dtype {arr.dtype}")
    return arr.astype(FLOAT32, copy=False)


def check_non_negative(name: str, arr: np.ndarray) -> None:
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{name}: values must be >= 0, got {int(arr.min())}")


def check_same_length(what: str, **arrays: Any) -> None:
    """All arrays (or lists) given have one length; the error lists every length."""
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{name} ({n})" for name, n in lengths.items())
        raise ValueError(f"{what}: {listed} must have one entry per token")
