"""How an update's bytes travel from the trainer to the replicas: `Transport` names each way.

Each transport is one object with both of its sides, `send` (what `WeightSender` does with it)
and `receive` (what `WeightReceiver` does with its source), found by `weight_sync.transports.table`:

* `gloo` / `nccl`: `bucket_broadcast.DistributedTransport`, over a weight-update group
  (`distributed`);
* `shm`: `shared_memory.SharedMemoryTransport`, a /dev/shm segment (`shm`) on CPU, CUDA IPC
  handles on GPU;
* `disk`: `disk.DiskTransport`, a safetensors directory per version.

A new transport is its module (mechanism, `send`, `receive`), its source in
`weight_sync.sources`, a member here and a row of the table.
"""

from __future__ import annotations

import enum


class Transport(str, enum.Enum):
    """What a `WeightSender` moves the bytes over; a string from a CLI or a config converts at
    the edge: `Transport("shm")`."""

    GLOO = "gloo"  # a torch.distributed broadcast on CPU, any hosts
    NCCL = "nccl"  # the same between GPUs
    SHM = "shm"  # this host only: one copy out of shared memory (CUDA IPC for GPU tensors)
    DISK = "disk"  # a directory every replica can read: also a checkpoint per version


__all__ = ["Transport"]
