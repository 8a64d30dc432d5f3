"""A trainer's tensors as the `serialized_named_tensors` entry of SGLang's
`update_weights_from_tensor`, without pickle: the tensors packed into a /dev/shm segment (the
`shm` transport's layout, the flat buckets SGLang's `flattened_bucket` format stands for) and our
msgpack handle to it, base64 as SGLang's HTTP clients send it.

    with TensorPayload(model.named_parameters(), version=7) as payload:
        post("/update_weights_from_tensor", {"serialized_named_tensors": [payload.text],
                                             "load_format": "flattened_bucket"})

The segment is this process's until `close()`: keep the payload open until the call returned
(the engine copies the buckets out before it answers). Same host only.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Iterable
from typing import Optional

import torch

from weight_sync.buckets import DEFAULT_BUCKET_BYTES, as_bytes, manifest_for
from weight_sync.sources import DEFAULT_PIECE_BYTES, SharedMemorySource, encode_tensor_payload
from weight_sync.transports.shm import SegmentPlan, SharedRegion, fill_segment


class TensorPayload:
    """Named CPU tensors in a shared-memory segment and the handle to it (see module docstring)."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], *, version: Optional[int] = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
        named = [(name, t.detach()) for name, t in named]
        if not named:
            raise ValueError("TensorPayload: no tensors")
        if any(t.device.type != "cpu" for _, t in named):
            raise ValueError("TensorPayload: CPU tensors only (a GPU trainer's are shared by the shm transport's "
                             "CUDA IPC path, through a WeightSender)")
        manifest = manifest_for(named, bucket_bytes=bucket_bytes, version=version)
        plan = SegmentPlan.of(manifest, piece_bytes)
        token = secrets.randbits(63) or 1
        self.region = SharedRegion(plan.segment_bytes)
        try:
            fill_segment(self.region, plan, [as_bytes(t).numpy() for _, t in named], token)
        except BaseException:
            self.region.close()
            raise
        self.source = SharedMemorySource(manifest=manifest, segment=self.region.name, token=token,
                                         piece_bytes=plan.piece_bytes)
        self.nbytes = manifest.total_bytes

    @property
    def data(self) -> bytes:
        """The handle, msgpack."""
        return encode_tensor_payload(self.source)

    @property
    def text(self) -> str:
        """The handle as base64 text (what goes in the JSON body)."""
        return base64.b64encode(self.data).decode()

    def close(self) -> None:
        self.region.close()

    def __enter__(self) -> TensorPayload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
