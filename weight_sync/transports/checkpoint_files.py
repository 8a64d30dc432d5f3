"""The files of a checkpoint directory a replica was told to read, opened so that a request cannot
make it read anything else, nor wait on anything but a regular file.

A disk update names a path; whoever sends it may not be trusted with the server's filesystem.
So (`CheckpointDir`):

* the directory is opened once (`O_DIRECTORY`) and checked against the server's `DiskAccess`
  (the `--weights-root` directories) by the path the kernel says it has, so a symlink inside a
  root that leads out of it is refused; every file is then opened by plain name relative to that
  descriptor, `O_NOFOLLOW | O_NONBLOCK`, and read only if `fstat` says it is a regular file: no
  symlink, no index entry with a `/` or `..`, and no FIFO or device (whose `open` or `read`
  would block the reading thread, with the GIL, for as long as nobody writes);
* safetensors files are parsed and read by `safetensors_file.SafetensorsFile` (the header checked:
  offsets, sizes, dtypes; the data read with `readinto` in chunks, which releases the GIL, by the
  update's deadline), so a slow disk costs the receiver's worker thread only: the server's socket
  thread and the engine's loop go on;
* every refusal is a `CheckpointError` (a `ValueError`: the request's fault). A path that is no
  directory, is absent, cannot be read or holds no safetensors gets one and the same message, so
  a caller learns nothing about the server's filesystem beyond "not a checkpoint".
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from weight_sync.transports.safetensors_file import CheckpointError, SafetensorsFile, TensorEntry, read_into

INDEX_FILE = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 * 2**20  # an index or a manifest


class DiskAccessError(CheckpointError):
    """This server reads no checkpoint there (outside every `--weights-root`, or none allowed)."""


def not_a_checkpoint(path: str | Path) -> CheckpointError:
    # NOTE: one message for absent, not a directory, unreadable and empty: the caller may not probe the filesystem
    return CheckpointError(f"{path}: not a checkpoint directory this server can read (a directory of "
                           "*.safetensors files)")


@dataclass(frozen=True, slots=True)
class DiskAccess:
    """Which directories disk updates may read: `roots` and what lies under them, or, with
    `anywhere`, any directory (a server that only loopback clients reach, or in-process use)."""

    roots: tuple[Path, ...] = ()
    anywhere: bool = True

    @classmethod
    def of(cls, roots: Iterable[str | Path], *, beyond_loopback: bool) -> DiskAccess:
        """Only under `roots` if any are given; else anywhere on loopback, nowhere beyond it."""
        # NOTE: each root as named and as resolved: a request names the first, the opened directory shows the second
        forms = dict.fromkeys(p for r in roots for p in (_absolute(r), Path(os.path.realpath(r))))
        return cls(tuple(forms), anywhere=not forms and not beyond_loopback)

    def check(self, path: str | Path, shown: str | Path) -> None:
        """Refuse (`DiskAccessError`, naming `shown`, the caller's path) a `path` outside every root."""
        if self.anywhere:
            return
        if not self.roots:
            raise DiskAccessError("disk weight updates are off: this server listens beyond loopback and was given "
                                  "no --weights-root")
        absolute = _absolute(path)
        if not any(absolute == root or root in absolute.parents for root in self.roots):
            raise DiskAccessError(f"{shown}: outside every --weights-root of this server")


ANYWHERE = DiskAccess()


class CheckpointDir:
    """One open checkpoint directory (see module docstring); a context manager that closes it.
    Every read ends by `timeout_s` after it was opened (`TimeoutError` past that)."""

    def __init__(self, path: str | Path, access: DiskAccess, timeout_s: float) -> None:
        self.path = str(path)
        self.deadline = time.monotonic() + timeout_s
        access.check(path, self.path)  # NOTE: the path as named first, before the filesystem is touched
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, ValueError):
            raise not_a_checkpoint(self.path) from None
        try:
            access.check(_path_of(self.fd, path), self.path)  # then where it really is (a symlink may lead out)
        except BaseException:
            os.close(self.fd)
            raise

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    # ---- files by name ---------------------------------------------------------------------------

    def open_file(self, name: str) -> Optional[int]:
        """A descriptor of the regular file `name` directly in the directory, None if there is none."""
        if not name or "/" in name or "\0" in name or name in (".", ".."):
            raise CheckpointError(f"{self.path}: {name!r} is not a file name in the directory")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:  # NOTE: ELOOP is a symlink: refused like anything not a plain file
            raise CheckpointError(f"{self.path}: {name} is not a regular file it can read ({exc.strerror})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"{self.path}: {name} is not a regular file")
        return fd

    def read_json(self, name: str) -> Optional[bytes]:
        """The bytes of the small file `name` (an index, a manifest), None if there is none."""
        fd = self.open_file(name)
        if fd is None:
            return None
        with os.fdopen(fd, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_JSON_BYTES:
                raise CheckpointError(f"{self.path}: {name} holds {size} bytes, over {MAX_JSON_BYTES}")
            buf = bytearray(size)
            read_into(f, memoryview(buf), self.deadline, f"{self.path}: {name}")
            return bytes(buf)

    def safetensors_files(self) -> list[str]:
        """The safetensors files of the checkpoint: its index's, else those in the directory."""
        raw = self.read_json(INDEX_FILE)
        if raw is not None:
            try:
                files = sorted(set(json.loads(raw)["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise CheckpointError(f"{self.path}: {INDEX_FILE} is not a safetensors index") from None
            if not all(isinstance(f, str) for f in files):
                raise CheckpointError(f"{self.path}: {INDEX_FILE} names a file that is not a string")
        else:
            files = sorted(n for n in os.listdir(self.fd) if n.endswith(".safetensors"))
        if not files:
            raise not_a_checkpoint(self.path)
        return files

    # ---- safetensors -----------------------------------------------------------------------------

    def safetensors(self, name: str) -> Optional[SafetensorsFile]:
        """The safetensors file `name` open, its header checked (None if there is none); close it."""
        fd = self.open_file(name)
        return None if fd is None else SafetensorsFile(fd, f"{self.path}: {name}", self.deadline)

    def read_tensors(self, name: str, buffer: Optional[Callable[[int], torch.Tensor]] = None,
                     direct: Optional[Mapping[str, torch.Tensor]] = None) -> Optional[dict[str, torch.Tensor]]:
        """Every tensor of the safetensors file `name` (`SafetensorsFile.read`), None if there is none."""
        opened = self.safetensors(name)
        if opened is None:
            return None
        with opened:
            return opened.read(buffer, direct)

    def headers(self) -> dict[str, dict[str, TensorEntry]]:
        """Each safetensors file's checked header, by file (an index's files must all be there)."""
        out = {}
        for name in self.safetensors_files():
            opened = self.safetensors(name)
            if opened is None:
                raise CheckpointError(f"{self.path}: {name} is missing")
            with opened:
                out[name] = opened.entries
        return out


def _absolute(path: str | Path) -> Path:
    return Path(os.path.normpath(os.path.abspath(path)))


def _path_of(fd: int, fallback: str | Path) -> str:
    """Where the open directory `fd` really is (the kernel's word; `realpath` where /proc is not)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(fallback)
