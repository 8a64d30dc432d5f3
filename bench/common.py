"""Helpers shared by the engine benchmarks: thread set-up, the machine line, models, medians,
the engine's config under either name of its step-token field, and the `RESULT {json}` line.

NOTE: the benchmark scripts set `OMP_WAIT_POLICY=PASSIVE` (unless the environment sets it) before
torch is imported. On a shared 2-core machine, OpenMP's default spin-waiting makes a 2-thread
`[64, 256] x [256, 1024]` matmul take ~30 ms instead of ~0.4 ms whenever another process holds a
core; passive waiting removes that cliff for every engine alike. `machine_line()` prints the policy.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TINY_LLAMA = dict(
    vocab_size=32_000,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)


def machine_line() -> str:
    """Threads, OpenMP wait policy, load average and versions: print it beside every figure."""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"torch {torch.__version__}, threads {torch.get_num_threads()} of {os.cpu_count()} cores, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, load average {load}"
    )


def load_average() -> float:
    return os.getloadavg()[0]


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """A model under test: its display name and how to build the HF `*ForCausalLM`."""

    name: str
    description: str


TINY = ModelChoice("tiny", "random Llama, 4 layers, hidden 256, ffn 1024, 4/2 heads, vocab 32000")
SMOLLM2 = ModelChoice("smollm2", "SmolLM2-135M-Instruct (30 layers, hidden 576, vocab 49152)")
MODELS = {m.name: m for m in (TINY, SMOLLM2)}


def hf_model(choice: ModelChoice, dtype: torch.dtype, seed: int = 0):
    """The HF model of `choice` in `dtype`, in eval mode, with SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if choice is TINY:
        torch.manual_seed(seed)
        config = LlamaConfig(**TINY_LLAMA, attn_implementation="sdpa")
        return LlamaForCausalLM(config).to(dtype).eval()
    from inference.models.smollm2 import smollm2_dir

    return LlamaForCausalLM.from_pretrained(smollm2_dir(), dtype=dtype, attn_implementation="sdpa").eval()


def random_peft(base, rank: int, seed: int):
    """A PEFT LoRA of `rank` (alpha 2 x rank) on every projection the engine adapts, over a copy of
    `base`: A random, B ~ N(0, 0.01), as an adapter after some training."""
    import copy

    from peft import LoraConfig, get_peft_model

    from inference.lora import LORA_PROJECTIONS

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank,
                                                          target_modules=list(LORA_PROJECTIONS),
                                                          init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.01)
    return model.eval()


RESULT_PREFIX = "RESULT "


def print_result(bench: str, figures: Mapping[str, float], **context: object) -> None:
    """One machine-readable line, `RESULT {"bench": ..., "figures": {...}, ...}`, for
    `bench/throughput/compare_commits.py`: figure names are the ones it compares across commits."""
    payload = {"bench": bench, "figures": {k: float(v) for k, v in figures.items()}, **context}
    print(RESULT_PREFIX + json.dumps(payload, sort_keys=True), flush=True)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Stopwatch:
    """Accumulates seconds per named phase; `wrap` times every call of a callable."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn):
        seconds = self.seconds
        seconds.setdefault(name, 0.0)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        """The seconds since the last `take()`, per phase; the counters restart at zero."""
        out = dict(self.seconds)
        for name in self.seconds:
            self.seconds[name] = 0.0
        return out


def llama_spec(hidden: int, layers: int, intermediate: int, vocab: int, dtype: torch.dtype):
    """A Llama `ModelSpec` of these sizes (64-dim heads, a KV head per 4 query heads), for random
    `DenseDecoder`s that need no HF module (a 1B HF init alone takes minutes on 2 cores)."""
    from inference.models.spec import ModelFamily, ModelSpec

    return ModelSpec(family=ModelFamily.LLAMA, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                     num_layers=layers, num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256), head_dim=64,
                     dtype=dtype)


# the weight benches' model sizes (bench/weights/)
SIZES = {  # name -> (hidden, layers, intermediate, vocab): Llama shapes of ~10M / 99M / 491M / 1.03B parameters
    "10M": (256, 8, 1024, 8192),
    "100M": (768, 8, 2048, 32000),
    "500M": (1024, 28, 4096, 32000),
    "1B": (2048, 20, 5632, 32000),
}


def spec_for(name: str, dtype: torch.dtype):
    """`llama_spec` of one of `SIZES`."""
    return llama_spec(*SIZES[name], dtype)


def random_weights(spec, seed: int) -> dict[str, torch.Tensor]:
    """Every weight of `spec`, N(0, 0.02) from `seed`, in its dtype (the weight benches' trainer)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(shape, generator=gen) * 0.02).to(spec.dtype) for n, shape in spec.weight_shapes().items()}
