"""vLLM's broadcast layout of a weight update, both ends, for peers that speak vLLM's RL API.

What travels (vLLM `VLLM_VERSION`'s `NCCLWeightTransferEngine`, `packed_tensor.py`), over a
weight-update group whose rank 0 is the trainer and whose workers start at `rank_offset`:

* unpacked (`packed` false): one broadcast per tensor, in `names` order, each its own bytes;
* packed: the tensors' bytes concatenated in `names` order, no padding, cut into chunks: a chunk
  takes tensors until its total exceeds `packed_buffer_size_bytes` (the tensor that crosses the
  line is its last one, so a tensor larger than the buffer travels in a chunk of its own, or with
  those before it), one broadcast per chunk. The receiver computes the same cut from the
  per-parameter metadata (`names`, `dtype_names`, `shapes`) alone. The trainer keeps
  `packed_num_buffers` chunks in flight (vLLM's rotating buffers); that changes no byte on the wire.

Both ends over a weight-update group: `weight_sync.transports.vllm_broadcast`.

`tests/fixtures/vllm_packing` holds what vLLM's own producer broadcast for tiny tensors; the
tests compare `pack_chunks` with it byte for byte. vLLM's consumer views each tensor in place,
which fails for a tensor at an offset its dtype does not divide; `unpack_chunk` copies those.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch

from weight_sync.manifest import Manifest, dtype_name, tensor_nbytes

VLLM_VERSION = "0.22.1"  # the release mirrored (as rollout.http.vllm.vllm_routes.VLLM_API_VERSION); its packing is
# the same from 0.16 through 0.23 (their API docs) to the main commit the fixture ran (tests/fixtures/vllm_packing)
# NOTE: vLLM's init_info names no group: both ends use this one (its name prefixes the group's store keys)
VLLM_GROUP = "vllm_weight_transfer"
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024**3  # vLLM's defaults, which the trainer and workers must share
DEFAULT_PACKED_NUM_BUFFERS = 2


def plan_chunks(sizes: Sequence[int], buffer_bytes: int) -> list[range]:
    """The tensors (indices) of each packed chunk, given each tensor's byte size."""
    if buffer_bytes < 1:
        raise ValueError(f"packed_buffer_size_bytes must be >= 1, got {buffer_bytes}")
    chunks, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > buffer_bytes:
            chunks.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        chunks.append(range(start, len(sizes)))
    return chunks


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).view(-1)


def pack_chunks(tensors: Sequence[torch.Tensor], buffer_bytes: int,
                device: Optional[torch.device] = None) -> Iterable[torch.Tensor]:
    """Each chunk's bytes (uint8, on `device`, default the tensors' own), built one at a time."""
    for chunk in plan_chunks([t.numel() * t.element_size() for t in tensors], buffer_bytes):
        parts = [flat_bytes(tensors[i]) for i in chunk]
        packed = torch.cat(parts) if len(parts) > 1 else parts[0]  # NOTE: a lone tensor travels as it lies
        yield packed if device is None else packed.to(device)


def unpack_chunk(chunk: torch.Tensor, manifest: Manifest, indices: range) -> dict[str, torch.Tensor]:
    """The tensors `indices` of `manifest` in `chunk`: views where the offset allows, else copies."""
    out, at = {}, 0
    for i in indices:
        dtype, shape = manifest.torch_dtypes[i], manifest.shapes[i]
        size = tensor_nbytes(dtype, shape)
        piece = chunk[at : at + size]
        item = torch.empty((), dtype=dtype).element_size()
        if (piece.storage_offset() % item) != 0:
            piece = piece.clone()  # NOTE: vLLM's consumer fails here; a fresh tensor is aligned
        out[manifest.names[i]] = piece.view(dtype).view(shape)
        at += size
    return out


def update_info(named: Sequence[tuple[str, torch.Tensor]], *, packed: bool = True,
                buffer_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> dict[str, Any]:
    """vLLM's `update_info` (`NCCLWeightTransferUpdateInfo`) for these tensors."""
    info: dict[str, Any] = {"names": [n for n, _ in named], "dtype_names": [dtype_name(t.dtype) for _, t in named],
                            "shapes": [list(t.shape) for _, t in named], "packed": packed}
    if packed:
        info.update(packed_buffer_size_bytes=buffer_bytes, packed_num_buffers=num_buffers)
    return info


__all__ = ["DEFAULT_PACKED_BUFFER_SIZE_BYTES", "DEFAULT_PACKED_NUM_BUFFERS", "VLLM_GROUP", "VLLM_VERSION", "flat_bytes",
           "pack_chunks", "plan_chunks", "unpack_chunk", "update_info"]
