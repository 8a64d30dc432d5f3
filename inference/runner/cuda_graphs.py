"""Piecewise CUDA graphs: the model captured once per padded bucket, attention run eagerly between.

A step of `T` padded tokens is cut at its attention calls into `L + 1` pieces: embedding, RoPE and
block 0's q/k/v; then per block `i` its output projection, MLP (or MoE: router, all-to-all,
experts) and block `i + 1`'s q/k/v; then the last block's rest. Each piece is a CUDA graph over
static tensors: the runner's persistent input buffers (their addresses never change), the
previous piece's outputs, and a static attention-output tensor the runner copies into. Attention
itself runs eagerly between pieces, planned from the step's metadata, so one capture per token
count serves decode-only steps and mixed (prefill + decode) steps alike, whatever their sequence
lengths. The LM head runs eagerly on the rows to sample.

The model provides the pieces (`embed`, `rope`, `attention_inputs`, `after_attention`, `head`, as
`DenseDecoder` and `MoeDecoder` do) and `static_shapes` (MoE: fixed-shape exchanges, no host
sync). All graphs share one memory pool. `release()` drops graphs, their static tensors and the
pool and empties the CUDA cache (suspend: memory goes back to the trainer; keeping a pool alive
across suspends is the leak colocated engines are known for); `capture_all()` captures again
(resume). Weights updated in place keep the graphs valid (same addresses); a rebind changes
`model.weights_signature()`, and `check_weights()` re-captures.

`eager_piecewise` runs the same pieces without graphs: the CPU reference of the replay path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from inference.cache.kv_buffer import KVCacheBuffer
from inference.runner.inputs import InputBuffers, StepInputs

PIECES = ("embed", "rope", "attention_inputs", "after_attention", "head", "weights_signature")


def supports_pieces(model: Any) -> bool:
    return all(hasattr(model, name) for name in PIECES)


@torch.no_grad()
def eager_piecewise(model: Any, inputs: StepInputs, kv_cache: KVCacheBuffer) -> torch.Tensor:
    """The replay path's piece sequence, run eagerly over every padded row (CPU reference)."""
    model.check_sequence_lengths(inputs.meta)
    model.backend.plan(inputs.meta, kv_cache)
    x = model.embed(inputs.input_ids)
    cos, sin = model.rope(inputs.positions)
    for i in range(model.spec.num_layers):
        o = model.backend.forward(i, *model.attention_inputs(i, x, cos, sin), kv_cache)
        x = model.after_attention(i, x, o)
    return model.head(x.index_select(0, inputs.logits_indices))


class _Bucket:
    """One captured token count: its graphs, their static tensors (kept alive with the graphs: the
    pool would hand their memory to later captures otherwise)."""

    __slots__ = ("graphs", "qkv", "o", "x", "keep")

    def __init__(self) -> None:
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.qkv: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.o: list[torch.Tensor] = []
        self.x: torch.Tensor | None = None
        self.keep: list[torch.Tensor] = []


class PiecewiseGraphs:
    """The captured buckets of one model (see module docstring).

    Invariants: a bucket is replayed only while `model.weights_signature()` equals the one at
    capture (`check_weights` re-captures otherwise); every bucket's graphs come from one pool,
    dropped whole by `release()`.
    """

    def __init__(self, model: Any, buffers: InputBuffers, sizes: Sequence[int]) -> None:
        if not supports_pieces(model):
            raise ValueError(f"cuda_graphs: {type(model).__name__} does not expose the pieces {PIECES}")
        self.model = model
        self.buffers = buffers
        self.sizes = tuple(sorted(sizes, reverse=True))  # NOTE: largest first, smaller ones reuse its pool
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None
        self._signature: tuple[int, ...] | None = None
        self.captures = 0
        self.capture_seconds = 0.0

    def has(self, size: int) -> bool:
        return size in self._buckets

    # ---- capture -----------------------------------------------------------------------------

    @torch.no_grad()  # NOTE: aliased trainer parameters require grad; a graph must not record autograd
    def capture_all(self) -> None:
        self.release()
        model = self.model
        start = time.perf_counter()
        static, model.static_shapes = getattr(model, "static_shapes", False), True
        routes = getattr(model, "routes", None)
        recording = routes.active if routes is not None else False
        if routes is not None:
            routes.active = True  # NOTE: captured once, so the graphs always write routes
        try:
            torch.cuda.synchronize()
            self._pool = torch.cuda.graph_pool_handle()
            for size in self.sizes:
                self._buckets[size] = self._capture(size)
        finally:
            model.static_shapes = static
            if routes is not None:
                routes.active = recording
        torch.cuda.synchronize()
        self._signature = model.weights_signature()
        self.captures += 1
        self.capture_seconds += time.perf_counter() - start

    def _capture(self, size: int) -> _Bucket:
        m, layers = self.model, self.model.spec.num_layers
        ids, pos = self.buffers.t["input_ids"][:size], self.buffers.t["positions"][:size]
        width = m.spec.num_heads * m.spec.head_dim
        bucket = _Bucket()
        bucket.o = [torch.zeros(size, width, dtype=m.spec.dtype, device=ids.device) for _ in range(layers)]

        def first():
            x = m.embed(ids)
            cos, sin = m.rope(pos)
            return (x, cos, sin, *m.attention_inputs(0, x, cos, sin))

        def middle(i, x, cos, sin):
            x = m.after_attention(i - 1, x, bucket.o[i - 1])
            return (x, *m.attention_inputs(i, x, cos, sin))

        # warm-up on a side stream: lazy initialisation (cuBLAS handles, ...) must not be captured
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x, cos, sin, *_ = first()
            for i in range(1, layers):
                x, *_ = middle(i, x, cos, sin)
            m.after_attention(layers - 1, x, bucket.o[-1])
        torch.cuda.current_stream().wait_stream(side)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            x, cos, sin, q, k, v = first()
        bucket.graphs.append(graph)
        bucket.qkv.append((q, k, v))
        bucket.keep += [x, cos, sin]
        for i in range(1, layers):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                x, q, k, v = middle(i, x, cos, sin)
            bucket.graphs.append(graph)
            bucket.qkv.append((q, k, v))
            bucket.keep.append(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.x = m.after_attention(layers - 1, x, bucket.o[-1])
        bucket.graphs.append(graph)
        return bucket

    # ---- replay ------------------------------------------------------------------------------

    @torch.no_grad()
    def replay(self, inputs: StepInputs, kv_cache: KVCacheBuffer) -> torch.Tensor:
        """Logits of `inputs` (whose padded size was captured): graphs with eager attention between."""
        bucket = self._buckets[inputs.padded_tokens]
        m = self.model
        m.check_sequence_lengths(inputs.meta)
        m.backend.plan(inputs.meta, kv_cache)
        bucket.graphs[0].replay()
        for i, (q, k, v) in enumerate(bucket.qkv):
            bucket.o[i].copy_(m.backend.forward(i, q, k, v, kv_cache))
            bucket.graphs[i + 1].replay()
        return m.head(bucket.x.index_select(0, inputs.logits_indices))

    # ---- life cycle --------------------------------------------------------------------------

    def check_weights(self) -> None:
        """Re-capture if the weights moved (a rebind); in-place updates keep the graphs."""
        if self._buckets and self.model.weights_signature() != self._signature:
            self.capture_all()

    def release(self) -> None:
        """Drop every graph, its static tensors and the pool; hand the memory back to CUDA."""
        if not self._buckets and self._pool is None:
            return
        self._buckets.clear()
        self._pool = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def stats(self) -> dict:
        return {"graph_buckets": sorted(self._buckets), "graph_captures": self.captures,
                "graph_capture_seconds": round(self.capture_seconds, 3)}
