"""Decode throughput with LoRA adapters mixed in the batch, against the base model alone.

SmolLM2-135M-Instruct (fp32 on CPU) with 4 PEFT adapters on all seven linear projections of every
layer, at rank 16 and, in a second set, rank 64. For each batch size B one engine holds B decoding
requests (`--prompt-len` random tokens each, EOS ignored, greedy) in each of three mixes:

* base: no request names an adapter (adapters are loaded: the step is the engine's plain one);
* r16: the B requests spread round-robin over the 4 rank-16 adapters (4 groups per step);
* r64: the same over the 4 rank-64 adapters.

Each mix is prefilled, then `--steps` decode steps are timed one by one; the mixes run in
interleaved repeats (base, r16, r64, base, ...) so load drift hits all alike, and the medians
over all timed steps are printed with the throughput ratio base step / mix step (>= 0.8 is the
aim: the LoRA work is one small GEMM pair per adapter and projection, not a loop per request).

Usage: `python bench/lora/lora_decode.py [--batches 16,64] [--steps 8] [--repeats 3] [--threads 2]`.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads OpenMP; see common.py

import argparse  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.common import SMOLLM2, hf_model, machine_line, median, print_result, random_peft, set_threads  # noqa: E402
from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams  # noqa: E402
from inference.lora import LORA_PROJECTIONS  # noqa: E402
from inference.models.smollm2 import smollm2_dir  # noqa: E402

TARGETS = LORA_PROJECTIONS
ADAPTERS = 4


def save_adapters(base, root: Path, rank: int) -> list[Path]:
    """`ADAPTERS` random PEFT adapters of `rank` on every linear projection, saved as PEFT saves them."""
    paths = []
    for k in range(ADAPTERS):
        model = random_peft(base, rank, seed=rank * 100 + k)
        path = root / f"r{rank}-{k}"
        model.save_pretrained(str(path))
        paths.append(path)
    return paths


def decode_steps(engine, prompts, loras, steps: int) -> list[float]:
    """Prefill `prompts` (request i on adapter `loras[i % len]`, or none), then time `steps` decode steps."""
    params = [SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True,
                             lora_name=None if not loras else loras[i % len(loras)]) for i in range(len(prompts))]
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    ctx = engine.core.context
    while len(ctx.active) < len(prompts) or (ctx.kv_len[ctx.active] < len(prompts[0])).any():
        engine.step()  # NOTE: until every request has its prompt's K/V: the timed steps are decodes only
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    set_threads(args.threads)
    print(machine_line())
    base = hf_model(SMOLLM2, torch.float32)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        paths = {rank: save_adapters(base, Path(tmp), rank) for rank in (16, 64)}
        del base
        engine = DynamicInferenceEngine.from_pretrained(smollm2_dir(torch.float32), InferenceConfig(
            block_size=16, num_blocks=1024, max_requests=max(batches), max_batch_tokens=2048,
            max_sequence_length=256, enable_prefix_caching=False, max_loras=2 * ADAPTERS, max_lora_rank=64))
        mixes = {"base": []}
        for rank, ps in paths.items():
            mixes[f"r{rank}"] = [f"r{rank}-{k}" for k in range(len(ps))]
            for name, p in zip(mixes[f"r{rank}"], ps):
                engine.load_lora(name, p)
    print(f"SmolLM2-135M fp32, {ADAPTERS} adapters per rank on {len(TARGETS)} projections x 30 layers, "
          f"prompt {args.prompt_len}, {args.steps} decode steps x {args.repeats} interleaved repeats")
    figures = {}
    rng = random.Random(0)
    for b in batches:
        times: dict[str, list[float]] = {m: [] for m in mixes}
        for _ in range(args.repeats):
            for mix, loras in mixes.items():
                prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(b)]
                times[mix] += decode_steps(engine, prompts, loras, args.steps)
        base_ms = median(times["base"]) * 1e3
        line = [f"B={b:3d}: base {base_ms:7.1f} ms/step ({b / base_ms * 1e3:7.0f} tok/s)"]
        figures[f"base_ms_b{b}"] = base_ms
        for mix in ("r16", "r64"):
            ms = median(times[mix]) * 1e3
            ratio = base_ms / ms
            line.append(f"{mix} {ms:7.1f} ms/step, throughput x{ratio:.2f} of base")
            figures[f"{mix}_ms_b{b}"], figures[f"{mix}_ratio_b{b}"] = ms, ratio
        print(" | ".join(line), flush=True)
    print_result("lora_decode", figures, threads=args.threads)


if __name__ == "__main__":
    main()
