"""What share of the machine's matmul rate a rollout reaches: useful FLOPs / wall time against the
rate this machine gives on the model's own GEMM shapes, measured in the same run.

Useful FLOPs per generated token (the issue's count): 2 x (non-embedding GEMM parameters + LM head)
plus attention's 4 x layers x hidden x context, context = the positions that token attends to
(prompt + the tokens before it + itself). Prefill is not counted: a rollout's product is its
sampled tokens, so re-reading a prompt is work the count does not credit.

The machine's rate: one decode step's GEMMs (each layer's q/k/v/o, gate/up/down and the LM head),
FLOPs / median time, at the best of several batch sizes and of the GEMM forms this machine has
(torch's `F.linear` and the engine's native kernel: `MatmulProbe`). That is the dense-matmul
ceiling for the shapes the engine multiplies; attention's reads are not GEMMs and the count above
credits them at the same rate, as the issue asks.

The roofline beside it: the machine's memory bandwidth (`memory_bandwidth`, in the same run) and a
decode step's least memory traffic (`DecodeStep`: every GEMM weight read once, each row's K/V over
its context), so a step's arithmetic intensity (FLOPs / bytes) can be set against the machine's
ridge (matmul rate / bandwidth): below it a step is bound by memory, above it by the matmuls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from bench.throughput.rollout_workload import Workload


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


def mean_context(work: Workload) -> float:
    """Positions a generated token attends to, averaged over the workload's tokens (see `useful_flops`)."""
    contexts = sum(length * (len(prompt) + 1) + length * (length - 1) // 2
                   for prompt, lengths in zip(work.prompts, work.lengths) for length in lengths)
    return contexts / work.useful_tokens


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """One decode step of `batch` rows at `context` positions each: its FLOPs (the issue's count)
    and the least it reads from memory (each GEMM weight once, each row's K and V over its context)."""

    batch: int
    context: float
    flops: float
    weight_bytes: float
    kv_bytes: float

    @classmethod
    def of(cls, config, batch: int, context: float, dtype: torch.dtype) -> DecodeStep:
        item = torch.empty((), dtype=dtype).element_size()
        shapes = gemm_shapes(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        gemm_flops = 2 * batch * sum(o * i for o, i in shapes)
        attention_flops = 4 * config.num_hidden_layers * config.hidden_size * context * batch
        kv_per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * item
        return cls(batch, context, gemm_flops + attention_flops, item * sum(o * i for o, i in shapes),
                   kv_per_position * context * batch)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte read."""
        return self.flops / self.bytes


def memory_bandwidth(mib: int = 256, repeats: int = 5) -> tuple[float, float]:
    """(read, copy) bytes/s of this machine's memory: a sum over, and a copy of, a `mib` MiB fp32
    tensor (far past the caches), median of `repeats` after a warm pass; a copy's bytes count its
    read and its write."""
    src = torch.ones(mib * 2**18)
    dst = torch.empty_like(src)
    reads, copies = [], []
    with torch.inference_mode():
        for attempt in range(repeats + 1):
            start = time.perf_counter()
            src.sum()
            middle = time.perf_counter()
            dst.copy_(src)
            end = time.perf_counter()
            if attempt:  # NOTE: the first pass faults the pages in
                reads.append(middle - start)
                copies.append(end - middle)
    nbytes = src.numel() * src.element_size()
    return nbytes / sorted(reads)[repeats // 2], 2 * nbytes / sorted(copies)[repeats // 2]


# the batch sizes the probe tries (and the engine's fullest decode batch, see `MatmulProbe`)
PROBE_BATCHES = (16, 32, 64, 128, 256)


@dataclass(frozen=True, slots=True)
class ProbeRate:
    """The machine's matmul rate: FLOP/s of the fastest GEMM form at its fastest batch size."""

    flops_per_s: float
    form: str
    batch: int


class MatmulProbe:
    """One decode step's GEMMs (each layer's q/k/v/o, gate/up/down and the LM head; random weights
    of the model's shapes) in `dtype`, at each of `batches` rows and in each GEMM form this machine
    has; `rate()` returns the fastest (median of `repeats` per form and batch).

    Forms: `F.linear` (torch's sgemm, MKL or oneDNN), and the engine's own dispatch
    (`inference.models.small_gemm.linear`, the native register-tiled kernel up to its row limit,
    and the vocabulary-chunked LM head, `inference.models.layers.lm_head`), where the tree has them.
    NOTE: the machine's rate is the best any of them reaches: a ceiling measured on torch's
    GEMMs alone would be one the engine's own kernel runs past (SmolLM2, one thread: 84 GFLOP/s
    against MKL's 76 at 64 rows), and the share would then flatter the engine.
    """

    def __init__(self, config, batches, dtype: torch.dtype) -> None:
        generator = torch.Generator().manual_seed(0)
        shapes = gemm_shapes(config)
        self.batches = sorted(set(batches))
        self.weights = [torch.randn(o, i, generator=generator).to(dtype) for o, i in shapes]
        widest = self.batches[-1]
        self.inputs = {i: torch.randn(widest, i, generator=generator).to(dtype) for _, i in shapes}
        self.step_flops = 2 * sum(o * i for o, i in shapes)  # per row
        self.forms = _gemm_forms()

    def rate(self, repeats: int = 5) -> ProbeRate:
        best = ProbeRate(0.0, "", 0)
        with torch.inference_mode():
            for batch in self.batches:
                inputs = {i: x[:batch] for i, x in self.inputs.items()}
                for form, (linear, head) in self.forms.items():
                    times = []
                    for attempt in range(repeats + 1):
                        start = time.perf_counter()
                        for w in self.weights[:-1]:
                            linear(inputs[w.shape[1]], w)
                        head(inputs[self.weights[-1].shape[1]], self.weights[-1])
                        if attempt:  # NOTE: the first pass warms the caches and the allocator
                            times.append(time.perf_counter() - start)
                    times.sort()
                    flops_per_s = batch * self.step_flops / times[len(times) // 2]
                    if flops_per_s > best.flops_per_s:
                        best = ProbeRate(flops_per_s, form, batch)
        return best


def _gemm_forms() -> dict:
    """`{name: (linear, lm_head)}`: torch's, and the engine's own where this tree has them."""
    linear = torch.nn.functional.linear
    forms = {"F.linear": (linear, linear)}
    try:
        from inference.models.layers import lm_head
        from inference.models.small_gemm import linear as engine_linear
    except ImportError:  # NOTE: a tree from before the native GEMM (compare_commits runs old trees)
        try:
            from inference.models.layers import lm_head
        except ImportError:
            return forms
        forms["engine"] = (linear, lm_head)
        return forms
    forms["engine"] = (engine_linear, lm_head)
    return forms
