"""vLLM's layout (`weight_sync.vllm_layout`) over a weight-update group: the trainer's broadcasts
(`send`, rank 0) and a worker's (`receive`), for the `/update_weights` calls of vLLM's RL API.

Unlike our bucket protocol there is no handshake and no checksum: every rank knows the
broadcasts from the metadata alone, so a worker that cannot take the update still receives
every broadcast (the trainer is never left waiting) and refuses after the last one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch

from weight_sync.manifest import Manifest
from weight_sync.transports.distributed import ReceiveBuffer, WeightGroup
from weight_sync.vllm_layout import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    pack_chunks,
    plan_chunks,
    unpack_chunk,
)


def send(group: WeightGroup, tensors: Sequence[torch.Tensor], *, packed: bool = True,
         buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES, num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> int:
    """Rank 0's side: broadcast `tensors` in vLLM's layout, `num_buffers` chunks in flight (each
    held until its broadcast is done: vLLM's rotating buffers); bytes sent."""
    if num_buffers < 1:
        raise ValueError(f"packed_num_buffers must be >= 1, got {num_buffers}")
    if packed:
        chunks = pack_chunks(tensors, buffer_bytes, group.device)
    else:
        chunks = (t.detach().to(group.device).contiguous().view(torch.uint8).view(-1) for t in tensors)
    sent = 0

    def counted(chunk: torch.Tensor) -> torch.Tensor:
        nonlocal sent
        sent += chunk.numel()
        return chunk

    group.pipeline((counted(c) for c in chunks), depth=num_buffers)
    return sent


def receive(group: WeightGroup, manifest: Manifest, buffer_bytes: Optional[int],
            load: Callable[[dict[str, torch.Tensor]], None], num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> int:
    """A worker's side: the broadcasts of `manifest` in vLLM's layout (`buffer_bytes` None:
    unpacked), into `num_buffers` rotating buffers, so a chunk arrives while the one before it is
    loaded; each chunk's tensors handed to `load` (views of a reused buffer: `load` copies them).
    Returns the bytes received. A failed load is raised after the last broadcast, so the trainer
    is never left waiting on this rank."""
    if buffer_bytes is None:
        chunks = [range(i, i + 1) for i in range(len(manifest.names))]
    else:
        chunks = plan_chunks(manifest.tensor_bytes(), buffer_bytes)
    sizes = manifest.tensor_bytes()
    nbytes = [sum(sizes[i] for i in chunk) for chunk in chunks]
    buffers = [ReceiveBuffer(group.device) for _ in range(max(1, num_buffers))]
    failure: Optional[BaseException] = None

    def arrived(k: int, data: torch.Tensor) -> None:
        nonlocal failure
        if failure is None:
            try:
                load(unpack_chunk(data, manifest, chunks[k]))
            except Exception as exc:  # noqa: BLE001 (raised once the trainer is done)
                failure = exc

    landing = (buffers[k % len(buffers)].get(n)[:n] for k, n in enumerate(nbytes))
    group.pipeline(landing, arrived, depth=len(buffers))
    if failure is not None:
        raise failure
    return sum(nbytes)
