"""Host byte moves with their checksum: one pass over the bytes instead of a copy and a sum.

Every function takes flat `uint8` numpy arrays (a CPU tensor's `.numpy()`, a read-only view of a
mapped segment) and returns the range's checksum: the sum, modulo 2**64, of its bytes read as
little-endian 64-bit words, the last partial word zero-padded (the sum `weight_sync.manifest`
defines). The native kernels (`inference/csrc/byte_sums.c`, built by `inference.native`) copy
with streaming stores and release the GIL; without a C compiler numpy does the same in two
passes.

`publish` / `wait` hand a piece of a shared segment from one process to another: a header slot
of two words, [token, checksum], written by the producer after the piece's bytes (release
order) and polled by the consumer (acquire order) until its token shows or a timeout passes.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from inference import native

MASK = 2**64 - 1
SLOT_WORDS = 2  # a header slot: token, checksum


def word_sum(src: np.ndarray) -> int:
    """The checksum of `src` (numpy's reduction reads at memory speed: no kernel needed)."""
    n = src.size
    full = n - n % 8
    total = int(np.add.reduce(src[:full].view("<u8"), dtype=np.uint64)) if full else 0
    if n % 8:
        total += int.from_bytes(src[full:].tobytes() + b"\0" * (8 - n % 8), "little")
    return total & MASK


def copy_sum(dst: np.ndarray, src: np.ndarray) -> int:
    """Copy `src` into `dst` (same length) and return the checksum of the bytes copied."""
    if dst.size != src.size:
        raise ValueError(f"copy_sum: {src.size} bytes into {dst.size}")
    lib = native.library()
    if lib is None or src.size == 0:
        np.copyto(dst, src)
        return word_sum(dst)
    out = ctypes.c_uint64()
    lib.copy_sum_u64(dst.ctypes.data, src.ctypes.data, src.size, ctypes.byref(out))
    return out.value


def publish(header: np.ndarray, slot: int, checksum: int, token: int) -> None:
    """Mark piece `slot` of a `uint64` header written: its checksum, then its token (release)."""
    lib = native.library()
    if lib is None:  # NOTE: numpy stores reach memory in program order on x86 and under the GIL's fences
        header[SLOT_WORDS * slot + 1] = checksum
        header[SLOT_WORDS * slot] = token
        return
    lib.publish_piece(header.ctypes.data + 8 * SLOT_WORDS * slot, checksum, token)


def wait(header: np.ndarray, slot: int, token: int, timeout_s: float) -> int | None:
    """Piece `slot`'s checksum once its token shows, or None after `timeout_s` without."""
    lib = native.library()
    if lib is None:
        deadline = time.monotonic() + timeout_s
        while int(header[SLOT_WORDS * slot]) != token:
            if time.monotonic() >= deadline:
                return None
            time.sleep(1e-4)
        return int(header[SLOT_WORDS * slot + 1])
    out = ctypes.c_uint64()
    status = lib.wait_piece(header.ctypes.data + 8 * SLOT_WORDS * slot, token, max(0, int(timeout_s * 1e6)),
                            ctypes.byref(out))
    return out.value if status == 0 else None
