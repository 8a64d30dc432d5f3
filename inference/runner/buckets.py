"""Batch shapes and the padded bucket a step runs as (what a CUDA graph is captured for).

A step's `BatchDims` are its tokens, its requests and whether any request prefills (a *mixed*
step). A decode-only step (one token per request) is padded by one-token requests to the smallest
of `decode_buckets`; a mixed step is padded by tokens to the smallest of `batch_buckets`; past the
largest bucket it runs eagerly, unpadded (`None`).

Expert-parallel ranks must all run the same shape (their all-to-alls and graphs must match), so
they first agree on the element-wise MAX of their dims (`BatchDims.to_list` / `from_list` over the
ZMQ communicator) and each pads its own batch to the bucket of the agreed dims: megatron-core's
`match_graph_config`. A rank with no requests reports `IDLE` and runs a dummy batch of that shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass(frozen=True, slots=True)
class BatchDims:
    """A step's shape before padding: `tokens`, `requests`, and whether any request prefills."""

    tokens: int
    requests: int
    prefill: bool

    @classmethod
    def of_plan(cls, query_lens: np.ndarray, num_decode: int) -> BatchDims:
        return cls(int(query_lens.sum()), int(query_lens.size), int(query_lens.size) > num_decode)

    def to_list(self) -> list[int]:
        """The wire form, reduced element-wise by MAX across ranks."""
        return [self.tokens, self.requests, int(self.prefill)]

    @classmethod
    def from_list(cls, values: Sequence[int]) -> BatchDims:
        tokens, requests, prefill = (int(v) for v in values)
        return cls(tokens, requests, bool(prefill))

    @property
    def idle(self) -> bool:
        return self.tokens == 0


IDLE = BatchDims(0, 0, False)


def pick_bucket(num_tokens: int, buckets: Optional[Sequence[int]]) -> int:
    """The smallest bucket >= `num_tokens`, or `num_tokens` itself (no padding) past the largest."""
    if buckets:
        for b in buckets:
            if b >= num_tokens:
                return b
    return num_tokens


class BucketPolicy:
    """Which padded size a step of given dims runs as (see module docstring).

    Invariant: `match(dims)` is None or a size >= `dims.tokens` (and >= `dims.requests`)."""

    def __init__(self, batch_buckets: Optional[Sequence[int]], decode_buckets: Optional[Sequence[int]] = None) -> None:
        self.mixed = tuple(batch_buckets or ())
        self.decode = tuple(decode_buckets or ()) or self.mixed

    @property
    def enabled(self) -> bool:
        return bool(self.mixed)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every padded size a step may run as (what CUDA graphs capture), largest first."""
        return tuple(sorted(set(self.mixed) | set(self.decode), reverse=True))

    def match(self, dims: BatchDims) -> Optional[int]:
        """The padded token count of a step of `dims` (megatron's `match_graph_config`); None: eager."""
        if dims.idle or not self.enabled:
            return None
        buckets = self.mixed if dims.prefill else self.decode
        size = pick_bucket(dims.tokens, buckets)
        return size if size in buckets else None
