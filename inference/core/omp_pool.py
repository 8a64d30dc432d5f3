"""Release the calling thread's OpenMP workers before another thread takes over the engine's steps.

GNU OpenMP (torch's runtime on Linux) lets its idle workers spin between parallel regions, so the
next region starts at once, but only while it manages no more threads than the process may run
on; past that it "throttles": a short spin, then a sleep on a futex, so every parallel region of
a step (each torch op and native kernel large enough to split over the threads) begins by waking
its workers. Each thread that ran a parallel region keeps a pool of workers of its own: with the
model loaded on the main thread (two threads on two cores), the engine loop's pool puts the count
over, and every step on the loop thread ran slower than the same step on the main thread.
Measured (SmolLM2 bf16, 2 cores, 128 requests shaped as the served bench's, 64 in flight): 26.0-27.8 s
stepped on a second thread, 19.7-21.9 s on the main thread, 21.9-22.3 s on the second thread once
the main thread's pool was released (`omp_pause_resource_all`, OpenMP 5.0) before it started.

A thread that runs parallel regions again later gets a pool again (e.g. a trainer stepping on the
main thread while the loop generates): this helps where the loop is the one thread computing.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from typing import Optional

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what is cheap to keep
RUNTIMES = ("libgomp", "libiomp", "libomp")  # OpenMP runtimes, as their files are named


@cache
def _runtime() -> Optional[ctypes.CDLL]:
    """The OpenMP runtime this process has loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
    except OSError:
        return None
    for path in sorted(paths):
        if path.rsplit("/", 1)[-1].startswith(RUNTIMES):
            try:
                lib = ctypes.CDLL(path)  # NOTE: already loaded: dlopen hands back the same library
                pause = lib.omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            return lib
    return None


def release_caller_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (module docstring); whether a runtime did.

    Call it on a thread that is outside any parallel region and about to stop computing."""
    lib = _runtime()
    if lib is None:
        return False
    status = lib.omp_pause_resource_all(OMP_PAUSE_SOFT)
    if status:
        logger.debug("omp_pause_resource_all refused (%d)", status)
    return status == 0
