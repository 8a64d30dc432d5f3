"""vLLM's layout (`weight_sync.vllm_layout`) over a weight-update group: the trainer's broadcasts
(`send`, rank 0) and a worker's (`receive`), for the `/update_weights` calls of vLLM's RL API.

Unlike our bucket protocol there is no handshake and no checksum: every rank knows the
broadcasts from the metadata alone, so a worker that cannot take the update still receives
every broadcast (the trainer is never left waiting) and refuses after the last one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from weight_sync.manifest import Manifest
from weight_sync.transports.distributed import WeightGroup
from weight_sync.vllm_layout import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    pack_chunks,
    plan_chunks,
    unpack_chunk,
)


def send(group: WeightGroup, tensors: Sequence[torch.Tensor], *, packed: bool = True,
         buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES, num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> int:
    """Rank 0's side: broadcast `tensors` in vLLM's layout, `num_buffers` chunks in flight; bytes sent."""
    if num_buffers < 1:
        raise ValueError(f"packed_num_buffers must be >= 1, got {num_buffers}")
    if packed:
        chunks = pack_chunks(tensors, buffer_bytes, group.device)
    else:
        chunks = (t.detach().to(group.device).contiguous() for t in tensors)
    in_flight: list[tuple[Any, torch.Tensor]] = []
    sent = 0
    for chunk in chunks:
        if len(in_flight) == num_buffers:
            group._wait(in_flight.pop(0)[0], "a packed broadcast")
        in_flight.append((group.broadcast_async(chunk), chunk))  # NOTE: held until its broadcast is done
        sent += chunk.numel() * chunk.element_size()
    for work, _ in in_flight:
        group._wait(work, "a packed broadcast")
    return sent


def receive(group: WeightGroup, manifest: Manifest, buffer_bytes: Optional[int],
            load: Callable[[dict[str, torch.Tensor]], None]) -> int:
    """A worker's side: the broadcasts of `manifest` in vLLM's layout (`buffer_bytes` None:
    unpacked), each chunk's tensors handed to `load`; bytes received. A failed load is raised
    after the last broadcast, so the trainer is never left waiting on this rank."""
    if buffer_bytes is None:
        chunks = [range(i, i + 1) for i in range(len(manifest.names))]
    else:
        chunks = plan_chunks(manifest.tensor_bytes(), buffer_bytes)
    sizes = manifest.tensor_bytes()
    received, failure = 0, None
    for chunk in chunks:
        buf = torch.empty(sum(sizes[i] for i in chunk), dtype=torch.uint8, device=group.device)
        group.broadcast(buf)
        received += buf.numel()
        if failure is None:
            try:
                load(unpack_chunk(buf, manifest, chunk))
            except Exception as exc:  # noqa: BLE001 (raised once the trainer is done)
                failure = exc
    if failure is not None:
        raise failure
    return received
