"""Native CPU kernels (plain C, OpenMP) in `inference/csrc/`, compiled on first use and cached.

Every `csrc/*.c` goes into one shared library, built with the system C compiler (`$CC`, else
`cc`) into `$ROLLOUT_ENGINE_CACHE` (default `~/.cache/rollout-engine`), keyed by the sources,
flags, compiler and CPU, under a file lock so that concurrent processes build it once.

It is built for this CPU (`-march=native`) unless `ROLLOUT_ENGINE_KERNEL_ARCH` names an x86-64
level (`x86-64-v2`, `-v3`, `-v4`, or just `v2` / `v3` / `v4`): the kernels reassociate their sums
to vectorise them, so their rounding follows the vector width the compiler chose. Built for one
named level, they round alike on every CPU that has it, which is how CI simulates other machines.
A level this CPU lacks is refused (its instructions would fault), like a failed build.
`library_at(level)` loads a level's build beside the engine's, so that the tests check the code
paths of a CPU below this one (the GEMM's AVX2 and SSE tiles on an AVX-512 machine) in every run.

Kernels are called through ctypes, which releases the GIL. Users: decode attention
(`attention/cpu_kernels.py`), the decode step's few-row GEMMs (`models/small_gemm.py`), the
sampler (`sampling/native.py`), the layers' rotary, RMSNorm and fused residual add + RMSNorm, fp32
and bf16 (`models/layers.py`) and weight sync's byte moves (`weight_sync/memcopy.py`).

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
from functools import cache, lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # in the cache key: the sources include them
# NOTE: never -ffast-math / -funsafe-math-optimizations: linking a shared library with them pulls
# in crtfastmath, which turns on flush-to-zero for the whole process when the library loads. The
# flags below allow the vectorised reductions without that.
_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
          "-fno-signed-zeros", "-freciprocal-math", "-fopenmp", "-shared", "-fPIC"]
# the CPU flags each x86-64 level needs beyond the one below it (the psABI's list, as /proc/cpuinfo names them)
LEVEL_FLAGS = {
    "x86-64-v2": {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"},
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
I64 = ctypes.c_int64
PTR = ctypes.c_void_p
# every exported kernel: its argument types (all return an int status, 0 = done)
SIGNATURES = {
    "paged_decode_f32": [PTR, I64, PTR, PTR, PTR, I64, PTR, PTR, ctypes.c_int, I64, I64, I64, I64, I64, ctypes.c_float,
                         ctypes.c_int],
    "paged_decode_bf16": [PTR, I64, PTR, PTR, PTR, I64, PTR, PTR, ctypes.c_int, I64, I64, I64, I64, I64,
                          ctypes.c_float, ctypes.c_int],
    "sample_rows_f32": [PTR, I64, I64, I64, PTR, PTR, PTR, PTR, PTR, PTR, ctypes.c_int],
    "rotary_f32": [PTR, I64, I64, I64, I64, PTR, PTR, ctypes.c_int],
    "rotary_bf16": [PTR, I64, I64, I64, I64, PTR, PTR, ctypes.c_int],
    "small_gemm_f32": [PTR, I64, I64, I64, PTR, I64, PTR, PTR, I64, ctypes.c_int],
    "small_gemm_f32_wide": [PTR, I64, I64, I64, PTR, I64, PTR, PTR, I64, ctypes.c_int],
    "small_gemm_f32_has_wide": [],
    "small_gemm_bf16": [PTR, I64, I64, I64, PTR, I64, PTR, PTR, I64, ctypes.c_int],
    "pack_pairs_bf16": [PTR, I64, I64, I64, PTR],
    "add_rms_norm_f32": [PTR, PTR, PTR, PTR, I64, I64, ctypes.c_float, ctypes.c_int, ctypes.c_int],
    "rms_norm_f32": [PTR, PTR, PTR, I64, I64, ctypes.c_float, ctypes.c_int, ctypes.c_int],
    "add_rms_norm_bf16": [PTR, PTR, PTR, PTR, I64, I64, ctypes.c_float, ctypes.c_int, ctypes.c_int],
    "store_rows": [PTR, PTR, PTR, PTR, I64, PTR, I64, I64],
    "silu_mul_bf16": [PTR, PTR, I64, I64, I64, ctypes.c_int],
    "decode_layers_bf16": [PTR, I64, PTR, I64, I64, I64, I64, I64, I64, PTR, PTR, PTR, PTR, I64, PTR, I64,
                           ctypes.c_float, ctypes.c_float, ctypes.c_int, PTR, I64, ctypes.c_int],
    "copy_sum_u64": [PTR, PTR, I64, PTR],
    "publish_piece": [PTR, ctypes.c_uint64, ctypes.c_uint64],
    "wait_piece": [PTR, ctypes.c_uint64, I64, PTR],
}


def _cache_dir() -> Path:
    root = os.environ.get("ROLLOUT_ENGINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rollout-engine")
    return Path(root) / "kernels"


def _cpu_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        return []


def _cpu_key() -> str:
    return platform.machine() + "".join(_cpu_lines())


def target_arch() -> str:
    """The `-march` the kernels are built for: `native`, or the x86-64 level the environment names.

    Raises ValueError for a name that is no level, or a level this CPU does not have."""
    name = os.environ.get("ROLLOUT_ENGINE_KERNEL_ARCH", "").strip().lower() or "native"
    return name if name == "native" else checked_level(name)


def checked_level(name: str) -> str:
    """`name` (`v2`, `x86-64-v3`, ...) as the x86-64 level it names; ValueError for a name that is
    no level, or a level this CPU does not have."""
    name = name.strip().lower()
    level = f"x86-64-{name}" if name in ("v2", "v3", "v4") else name
    if level not in LEVEL_FLAGS:
        raise ValueError(f"ROLLOUT_ENGINE_KERNEL_ARCH={name!r}: expected native, v2, v3 or v4 (x86-64 levels)")
    if platform.machine() not in ("x86_64", "AMD64"):
        raise ValueError(f"ROLLOUT_ENGINE_KERNEL_ARCH={name!r} names an x86-64 level; this is {platform.machine()}")
    flags = next((line.split(":", 1)[1].split() for line in _cpu_lines() if line.startswith("flags")), None)
    if flags is not None:
        levels = list(LEVEL_FLAGS)
        needed = set().union(*(LEVEL_FLAGS[lv] for lv in levels[: levels.index(level) + 1]))
        missing = sorted(needed - set(flags))
        if missing:
            raise ValueError(f"ROLLOUT_ENGINE_KERNEL_ARCH={level}: this CPU lacks {', '.join(missing)}")
    return level


def compiler() -> str | None:
    """The C compiler the kernels are built with (`$CC`, else `cc` or `gcc`), or None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str, arch: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [source.read_text() for source in (*_SOURCES, *_HEADERS)]
    flags = [f"-march={arch}", *_FLAGS]
    key = hashlib.sha256("\0".join([*texts, " ".join(flags), version, _cpu_key()]).encode())
    target = _cache_dir() / key.hexdigest()[:16] / "kernels.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # NOTE: another process may be building the same file
        if not target.exists():
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / "kernels.so"
                subprocess.run([cc, *flags, *map(str, _SOURCES), "-o", str(built), "-lm"], check=True,
                               capture_output=True, text=True, timeout=300)
                os.replace(built, target)
    return target


@lru_cache(maxsize=1)
def library():
    if os.environ.get("ROLLOUT_ENGINE_NO_KERNELS"):
        return None
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler found: CPU attention and sampling use the pure-torch paths (slower)")
        return None
    try:
        lib = _load(_build(cc, target_arch()))
    except ValueError as exc:
        logger.error("native CPU kernels not built: %s; using the pure-torch paths", exc)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the native CPU kernels failed (%s); using the pure-torch paths", detail)
        return None
    return lib


@cache
def library_at(level: str) -> ctypes.CDLL:
    """The kernels built for x86-64 `level` (`v2`, `v3`, `v4`), beside `library()`: how a test checks
    another CPU's code paths (each level has its own GEMM tiles) on this one. Raises ValueError for
    a level this CPU lacks, RuntimeError without a compiler, and the compiler's error if it fails."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found")
    return _load(_build(cc, checked_level(level)))


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def available() -> bool:
    """Whether the native kernels could be built and loaded on this machine."""
    return library() is not None
