"""Native CPU kernels (plain C, OpenMP), compiled on first use and cached per machine.

`paged_decode` computes decode attention straight from the KV pages (see csrc/paged_decode.c):
no gather into a padded batch, so a batch of mixed lengths costs what its tokens cost. The C
source is compiled with the system C compiler (`$CC`, else `cc`) for this CPU (`-march=native`)
into `$ROLLOUT_ENGINE_CACHE` (default `~/.cache/rollout-engine`), keyed by source, flags,
compiler and CPU, under a file lock so that concurrent processes build it once. It is called
through ctypes, which releases the GIL.

Where no compiler is found or the build fails, `available()` is False (logged once) and the
attention backend keeps its pure-torch path; `ROLLOUT_ENGINE_NO_KERNELS=1` forces that.
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

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# NOTE: never -ffast-math / -funsafe-math-optimizations: linking a shared library with them pulls
# in crtfastmath, which turns on flush-to-zero for the whole process when the library loads. The
# flags below allow the vectorised reductions without that.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-shared", "-fPIC"]
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int]


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
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), " ".join(_FLAGS), version, _cpu_key()]).encode())
    target = _cache_dir() / key.hexdigest()[:16] / "paged_decode.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # NOTE: another process may be building the same file
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / "paged_decode.so"
                subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], check=True,
                               capture_output=True, text=True, timeout=300)
                os.replace(built, target)
    return target


@lru_cache(maxsize=1)
def _library():
    if os.environ.get("ROLLOUT_ENGINE_NO_KERNELS"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU decode attention uses the pure-torch path (slower)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the CPU attention kernel failed (%s); using the pure-torch path", detail)
        return None
    for name in ("paged_decode_f32", "paged_decode_bf16"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
    return lib


def available() -> bool:
    """Whether the native kernels could be built and loaded on this machine."""
    return _library() is not None


_KERNELS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


def supports(dtype: torch.dtype, device: torch.device, num_heads: int, head_dim: int) -> bool:
    return device.type == "cpu" and dtype in _KERNELS and num_heads <= 64 and head_dim <= 256 and available()


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Decode attention of `q [B, Hq, D]` over the pages `k_cache`, `v_cache` `[blocks, bs, Hkv, D]`
    of one layer, request `b` attending to its first `seq_lens[b]` tokens through
    `block_tables [B, W]` (int32). Writes float32 `out [B, Hq, D]` and returns it.

    Every tensor must be contiguous (block_tables rows may have any stride); not checked on the
    hot path beyond what the C code needs.
    """
    batch, num_heads, head_dim = q.shape
    status = getattr(_library(), _KERNELS[q.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), out.data_ptr(), batch, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        scale, torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"paged_decode failed with status {status} (shape or memory)")
    return out
