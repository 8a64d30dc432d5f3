"""An adapter directory's two files, read so that nothing a client names can stall the reader.

The directory is opened once (`O_DIRECTORY`, non-blocking) and each file relative to it, also
non-blocking: a FIFO or a device swapped in for a file opens at once and is refused by `fstat` on
the descriptor that was opened (never a second open by name, which a swap could race), so a read
never waits on a writer that does not come. Only regular files are read, each up to a bound in
bytes (`MAX_CONFIG_BYTES`, `MAX_WEIGHTS_BYTES`), the safetensors header up to `MAX_HEADER_BYTES`
before anything parses it. `where(resolved)` is called with the opened directory's real path
before any file in it is read, so a server can refuse a directory outside where it may read
(a symlink that leads out included).
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable
from typing import Optional

from inference.errors import LoRALoadError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_WEIGHTS_BYTES = 16 << 30
MAX_HEADER_BYTES = 16 << 20  # a safetensors header is JSON naming each tensor: KBs for an adapter


def read_adapter_files(path: str, where: Optional[Callable[[str], None]] = None) -> tuple[bytes, bytes]:
    """(`adapter_config.json`, `adapter_model.safetensors`) of the adapter directory `path`, as bytes;
    `LoRALoadError` naming what is wrong (see module docstring)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):
        raise LoRALoadError(f"LoRA adapter directory {path!r} does not exist or is not a directory") from None
    try:
        if where is not None:
            where(_path_of(fd, path))
        config = _read(fd, ADAPTER_CONFIG, MAX_CONFIG_BYTES, path)
        weights = _read(fd, ADAPTER_WEIGHTS, MAX_WEIGHTS_BYTES, path)
    finally:
        os.close(fd)
    if len(weights) < 8 or struct.unpack("<Q", weights[:8])[0] > min(MAX_HEADER_BYTES, len(weights) - 8):
        raise LoRALoadError(f"LoRA adapter {path!r}: {ADAPTER_WEIGHTS} is not a safetensors file (its header is "
                            f"missing, cut short or over {MAX_HEADER_BYTES} bytes)")
    return config, weights


def _read(dir_fd: int, name: str, limit: int, path: str) -> bytes:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        raise LoRALoadError(f"LoRA adapter {path!r} has no {name}"
                            + (" (only safetensors are read)" if name == ADAPTER_WEIGHTS else "")) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LoRALoadError(f"LoRA adapter {path!r}: {name} is not a regular file")
        if info.st_size > limit:
            raise LoRALoadError(f"LoRA adapter {path!r}: {name} is {info.st_size} bytes; at most {limit} are read")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 24, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:  # NOTE: grew while read
            raise LoRALoadError(f"LoRA adapter {path!r}: {name} is over {limit} bytes")
        return b"".join(chunks)
    except OSError as exc:
        raise LoRALoadError(f"LoRA adapter {path!r}: {name} could not be read ({exc.strerror})") from None
    finally:
        os.close(fd)


def _path_of(fd: int, fallback: str) -> str:
    """Where the open directory `fd` really is (the kernel's word; `realpath` where /proc is not)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(fallback)
