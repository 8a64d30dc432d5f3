"""Measuring memory for suspend / resume: what the process holds, what the device has left."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def process_rss_bytes() -> int:
    """Resident set size of this process (Linux), the CPU measure of memory in use."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available_device_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on `device` (free GPU memory, or MemAvailable on CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def memory_in_use(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else process_rss_bytes()


@dataclass(frozen=True, slots=True)
class SuspendReport:
    """What a suspend did: bytes freed as measured (RSS on CPU, allocated memory on GPU).

    `workspace_bytes` are the per-step scratch buffers kept between steps (the sampler's and
    attention's), which suspend hands back too.
    """

    buffer_bytes: int  # KV (and state) buffer bytes that were allocated
    workspace_bytes: int
    offloaded_weight_bytes: int
    measured_freed_bytes: int
    requests_aborted: int
    requests_to_recompute: int
    requests_offloaded: int

    @classmethod
    def nothing(cls) -> SuspendReport:
        return cls(0, 0, 0, 0, 0, 0, 0)
