"""Native CPU kernels (plain C, OpenMP) in `inference/csrc/`, compiled on first use and cached.

Every `csrc/*.c` goes into one shared library, built with the system C compiler (`$CC`, else
`cc`) for this CPU (`-march=native`) into `$ROLLOUT_ENGINE_CACHE` (default
`~/.cache/rollout-engine`), keyed by the sources, flags, compiler and CPU, under a file lock so
that concurrent processes build it once. Kernels are called through ctypes, which releases the
GIL. Users: decode attention (`attention/cpu_kernels.py`), the sampler (`sampling_kernel.py`) and
weight sync's byte moves (`weight_sync/memcopy.py`).

Where no compiler is found or the build fails, `library()` is None (logged once) and every user
keeps its pure-torch path; `ROLLOUT_ENGINE_NO_KERNELS=1` forces that.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
# NOTE: never -ffast-math / -funsafe-math-optimizations: linking a shared library with them pulls
# in crtfastmath, which turns on flush-to-zero for the whole process when the library loads. The
# flags below allow the vectorised reductions without that.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-shared", "-fPIC"]
I64 = ctypes.c_int64
PTR = ctypes.c_void_p
# every exported kernel: its argument types (all return an int status, 0 = done)
SIGNATURES = {
    "paged_decode_f32": [PTR, PTR, PTR, PTR, I64, PTR, PTR, I64, I64, I64, I64, I64, ctypes.c_float, ctypes.c_int],
    "paged_decode_bf16": [PTR, PTR, PTR, PTR, I64, PTR, PTR, I64, I64, I64, I64, I64, ctypes.c_float, ctypes.c_int],
    "sample_rows_f32": [PTR, I64, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, ctypes.c_int],
    "copy_sum_u64": [PTR, PTR, I64, PTR],
    "publish_piece": [PTR, ctypes.c_uint64, ctypes.c_uint64],
    "wait_piece": [PTR, ctypes.c_uint64, I64, PTR],
}


def _cache_dir() -> Path:
    root = os.environ.get("ROLLOUT_ENGINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rollout-engine")
    return Path(root) / "kernels"


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [source.read_text() for source in _SOURCES]
    key = hashlib.sha256("\0".join([*texts, " ".join(_FLAGS), version, _cpu_key()]).encode())
    target = _cache_dir() / key.hexdigest()[:16] / "kernels.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # NOTE: another process may be building the same file
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / "kernels.so"
                subprocess.run([compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(built), "-lm"], check=True,
                               capture_output=True, text=True, timeout=300)
                os.replace(built, target)
    return target


@lru_cache(maxsize=1)
def library():
    if os.environ.get("ROLLOUT_ENGINE_NO_KERNELS"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU attention and sampling use the pure-torch paths (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the native CPU kernels failed (%s); using the pure-torch paths", detail)
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def available() -> bool:
    """Whether the native kernels could be built and loaded on this machine."""
    return library() is not None
