"""What share of the machine's matmul rate a rollout reaches: useful FLOPs / wall time against the
rate this machine gives on the model's own GEMM shapes, measured in the same run.

Useful FLOPs per generated token (the issue's count): 2 x (non-embedding GEMM parameters + LM head)
plus attention's 4 x layers x hidden x context, context = the positions that token attends to
(prompt + the tokens before it + itself). Prefill is not counted: a rollout's product is its
sampled tokens, so re-reading a prompt is work the count does not credit.

The machine's rate: one decode step's GEMMs (each layer's q/k/v/o, gate/up/down and the LM head)
at a batch of `batch` rows, FLOPs / median time. That is the dense-matmul ceiling for the shapes
the engine multiplies; attention's reads are not GEMMs and the count above credits them at the
same rate, as the issue asks.
"""

from __future__ import annotations

import time

import torch
from rollout_workload import Workload


def gemm_shapes(config) -> list[tuple[int, int]]:
    """`(out_features, in_features)` of every GEMM of one decode step of an HF Llama-like config."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q), (inter, hidden), (inter, hidden), (hidden, inter)]
    return layer * config.num_hidden_layers + [(config.vocab_size, hidden)]


def useful_flops(config, work: Workload) -> float:
    """FLOPs the issue's count credits for every sample's `lengths` tokens (see module docstring)."""
    per_token = 2 * sum(o * i for o, i in gemm_shapes(config))
    attention = 4 * config.num_hidden_layers * config.hidden_size
    total = 0.0
    for prompt, lengths in zip(work.prompts, work.lengths):
        p = len(prompt)
        for length in lengths:
            # NOTE: token i (0-based) attends to p + i + 1 positions; summed over i < length
            contexts = length * (p + 1) + length * (length - 1) // 2
            total += length * per_token + attention * contexts
    return total


class MatmulProbe:
    """One decode step's GEMMs at `batch` rows in `dtype`, built once (random weights of the model's
    shapes); `rate()` times them (median of `repeats`) and returns FLOP/s.

    NOTE: the LM head GEMM counts at the faster of `F.linear` over the whole weight and the
    engine's vocabulary-chunked form (`inference.models.layers.lm_head`, the same products): on CPU
    the chunked one is faster, and a ceiling the engine beats would not be the machine's.
    """

    def __init__(self, config, batch: int, dtype: torch.dtype) -> None:
        generator = torch.Generator().manual_seed(0)
        shapes = gemm_shapes(config)
        self.weights = [torch.randn(o, i, generator=generator).to(dtype) for o, i in shapes]
        self.inputs = {i: torch.randn(batch, i, generator=generator).to(dtype) for _, i in shapes}
        self.flops = 2 * batch * sum(o * i for o, i in shapes)

    def rate(self, repeats: int = 5) -> float:
        head = self._head_form()
        times = []
        with torch.inference_mode():
            for attempt in range(repeats + 1):
                start = time.perf_counter()
                for w in self.weights[:-1]:
                    torch.nn.functional.linear(self.inputs[w.shape[1]], w)
                head(self.inputs[self.weights[-1].shape[1]], self.weights[-1])
                if attempt:  # NOTE: the first pass warms the caches and the allocator
                    times.append(time.perf_counter() - start)
        times.sort()
        return self.flops / times[len(times) // 2]

    def _head_form(self, tries: int = 3):
        """`F.linear` or the engine's chunked LM head, whichever is faster here (median of `tries`);
        the timed loop then runs one head pass per attempt, as with `F.linear` alone."""
        linear = torch.nn.functional.linear
        try:
            from inference.models.layers import lm_head as chunked
        except ImportError:  # NOTE: a tree from before the chunked head
            return linear
        w = self.weights[-1]
        x = self.inputs[w.shape[1]]

        def median_time(fn) -> float:
            spans = []
            with torch.inference_mode():
                for _ in range(tries):
                    start = time.perf_counter()
                    fn(x, w)
                    spans.append(time.perf_counter() - start)
            return sorted(spans)[tries // 2]

        return chunked if median_time(chunked) < median_time(linear) else linear
