"""Device buffers whose memory really goes back when dropped (suspend hands it to the trainer)."""

from __future__ import annotations

import math
import mmap
import sys

import torch

# madvise's "fault in these pages now, writable" (Linux 5.14+; Python's mmap names it from 3.13)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PAGE = mmap.PAGESIZE


def returnable_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *,
                     resident: bool = False) -> torch.Tensor:
    """A zero-filled tensor whose memory is returned to the system once the last view is gone;
    `resident`: every page faulted in now (on CPU), not at its first write.

    NOTE: on CPU the tensor lives on an anonymous mapping of its own, so dropping it unmaps the
    pages at once. A malloc'd buffer may land on the heap (glibc raises its mmap threshold after
    each large free), where freed pages stay resident for the trainer. Fresh anonymous pages read
    as zeros and only count once touched. MAP_PRIVATE: Python's default MAP_SHARED is
    shmem-backed, with page faults ~1.8x slower. On GPU the caching allocator's memory is
    returned by `torch.cuda.empty_cache()`, which the suspend path calls.

    The mapping is advised for transparent huge pages: a rollout touches its KV pages for the first
    time while it decodes (after every resume, too), and a 2 MiB page costs one fault where 4 KiB
    pages cost 512 (zero-filling 512 MiB: ~125-150 ms in 4 KiB faults, ~25-40 ms in huge ones, on a
    Zen 4 VM; 3 of 11 huge-page trials took 220-780 ms, the host backing fresh memory). Whole
    SmolLM2 rollouts (16 x 4, engine alone, interleaved pairs): 1.04-1.09x. Unmapping still returns
    every page. Where THP is off the advice does nothing.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    region = mmap.mmap(-1, max(count * dtype.itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without THP: 4 KiB pages, as before
            pass
    out = torch.frombuffer(region, dtype=dtype, count=count).view(shape)
    if resident:
        _fault_in(region)
    return out


def _fault_in(region: mmap.mmap) -> None:
    """Every page of an anonymous mapping backed now; its contents (zeros) unchanged."""
    if sys.platform == "linux":
        try:
            region.madvise(MADV_POPULATE_WRITE)
            return
        except OSError:  # NOTE: a kernel before 5.14: a write to each page instead
            pass
    torch.frombuffer(region, dtype=torch.uint8)[::PAGE].zero_()
