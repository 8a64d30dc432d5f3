"""Speculative decoding on the tail of GRPO-shaped batches: wall time per batch and of its tail.

Two engines over the same model, one with `InferenceConfig.speculative` and one without, run the
same batches in turns (which one goes first alternates), each batch seeded alike for both, so
they must return the same tokens (checked: a mismatch is printed and the script exits 1). Each
round uses another seed, as RL epochs do; the speculative engine keeps its per-prompt history of
earlier samples across rounds (it is what it drafts from besides siblings).

Workloads (`--workload`):
* `arithmetic` (SmolLM2): the GRPO demo's task ("What is a + b?"), `--prompts` x `--n` samples at
  the demo's GRPO temperature (0.7, `--temperature`) with natural EOS up to `--max-tokens`: most
  samples answer in a few tokens, a few ramble.
* `random` (SmolLM2, the tiny random Llama and `--model hybrid`, a random Bamba: Mamba2 +
  attention, whose verify steps roll the Mamba state back): random-token prompts, lognormal output
  lengths (median `--median-len`, sigma 0.8, so a few samples run 4-8x the median), `ignore_eos`: a
  workload where little matches, to show what speculation costs when it does not pay.

Per batch: wall time, and the tail (wall time after 90% of the samples finished). Printed per
model and workload: medians over `--repeats` rounds, ratio = not speculative / speculative (> 1:
speculation is faster), the acceptance rate (kept / proposed tokens) and tokens per row of the
speculative steps, and tokens per engine step of both.

The ceiling beside them (`speculative_ceiling.py`): from each batch's tokens, the tail's speed-up
an oracle would reach if verify steps cost what plain ones do: `chain`, the engine's proposer with
every proposal verified; `tree`, the best continuation anywhere in the corpus after a match of
`min_match` tokens (and of one token): a bound for any proposal drawn from the corpus.
`--history-rounds` first runs that many untimed batches (other seeds) through the speculative
engine, so its per-prompt history is as full as in an RL loop that has seen its prompts before.

Usage: `python bench/speculation/speculative_tail.py [--model tiny|smollm2|hybrid|both]
[--workload arithmetic|random|both] [--repeats 3] [--prompts 8] [--n 8] [--threads 2]`. One `RESULT {json}`
line per model and workload.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads OpenMP; see common.py

import argparse  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import (  # noqa: E402
    MODELS,
    SMOLLM2,
    TINY,
    ModelChoice,
    hf_model,
    machine_line,
    median,
    print_result,
    set_threads,
)
from bench.speculation.speculative_ceiling import tail_bound  # noqa: E402
from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams  # noqa: E402
from inference.config import SpeculativeConfig  # noqa: E402
from inference.speculation.history import PromptHistory  # noqa: E402

HYBRID = ModelChoice("hybrid", "random Bamba (bench/throughput/hybrid.py): hidden 256, 3 Mamba2 + 1 attention layers, "
                              "vocab 32000")
TAIL_FRACTION = 0.9  # the tail starts when this share of a batch's samples has finished


def batch_of(workload: str, tokenizer, vocab: int, args, round_seed: int) -> tuple[list[list[int]], list]:
    """(prompts, per-prompt SamplingParams) of one batch; the prompts are the same every round."""
    if workload == "arithmetic":
        from rollout.rl.tasks import ArithmeticTask

        task = ArithmeticTask(tokenizer, high=99)
        prompts = [list(p.prompt_ids) for p in task.sample(random.Random(0), args.prompts)]
        params = [SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
                                 seed=round_seed * 1000 + i)
                  for i in range(len(prompts))]
        return prompts, params
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))] for _ in range(args.prompts)]
    lengths = random.Random(round_seed)
    out_prompts, params = [], []
    for i, prompt in enumerate(prompts):  # NOTE: one request per sample: each has its own length
        for j in range(args.n):
            length = min(args.max_tokens, max(1, round(args.median_len * math.exp(0.8 * lengths.gauss(0, 1)))))
            out_prompts.append(prompt)
            params.append(SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True,
                                         seed=round_seed * 100_000 + i * 100 + j))
    return out_prompts, params


def sample_prompts(prompts, params) -> list:
    """Each sample's prompt, in the order `generate` returns the samples."""
    return [prompt for prompt, p in zip(prompts, params) for _ in range(p.n)]


def remember(history: PromptHistory, prompts, params, outputs) -> None:
    for prompt, generated in zip(sample_prompts(prompts, params), outputs):
        history.add(tuple(prompt), np.asarray(generated, dtype=np.int64))


# the ceilings printed: (oracle, shortest match it continues); see speculative_ceiling.py
CEILINGS = {"chain": ("chain", None), "tree": ("tree", None), "tree_match1": ("tree", 1)}


def ceiling(history: PromptHistory, prompts, params, outputs, spec: SpeculativeConfig) -> dict[str, float]:
    """The tail's speed-up bound of each oracle in `CEILINGS` for one batch (before it joins `history`)."""
    per_sample = sample_prompts(prompts, params)
    earlier = {tuple(p): history.of(tuple(p)) for p in per_sample}
    return {name: tail_bound(per_sample, outputs, earlier, kind=kind, num_tokens=spec.num_tokens,
                             min_match=match or spec.min_match, max_match=spec.max_match,
                             tail_fraction=TAIL_FRACTION)["tail_bound"]
            for name, (kind, match) in CEILINGS.items()}


def timed_batch(engine: DynamicInferenceEngine, prompts, params) -> dict:
    steps0, stats0 = engine.num_steps, engine.stats()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    finished = sorted(o.finish_time - start for o in outputs)
    t90 = finished[max(0, math.ceil(TAIL_FRACTION * len(finished)) - 1)]
    stats = engine.stats()
    tokens = sum(len(o.generated_token_ids) for o in outputs)
    delta = {k: stats.get(k, 0) - stats0.get(k, 0) for k in ("spec_proposed_tokens", "spec_accepted_tokens",
                                                              "spec_rows", "spec_expected_tokens")}
    return dict(outputs=[o.generated_token_ids for o in outputs], wall=wall, tail=wall - t90, tokens=tokens,
                steps=engine.num_steps - steps0, **delta)


def run(model_name: str, workload: str, args) -> bool:
    if model_name == HYBRID.name:
        from bench.throughput.hybrid import hybrid_model

        choice, hf = HYBRID, hybrid_model("bamba")
    else:
        choice = MODELS[model_name]
        hf = hf_model(choice, torch.float32)
    tokenizer = None
    if choice is SMOLLM2:
        from transformers import AutoTokenizer

        from inference.models.smollm2 import smollm2_dir

        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    elif workload == "arithmetic":
        print(f"{model_name}: the arithmetic task needs a tokenizer; skipped")
        return True
    config = dict(block_size=16, max_requests=max(64, args.prompts * args.n), max_batch_tokens=2048,
                  max_sequence_length=1024, kv_memory_bytes=512 * 2**20)
    spec_config = SpeculativeConfig(num_tokens=args.spec_tokens, max_rows=args.max_rows,
                                    max_step_tokens=args.max_step_tokens)
    engines = {"plain": DynamicInferenceEngine.from_pretrained(hf, InferenceConfig(**config)),
               "spec": DynamicInferenceEngine.from_pretrained(hf, InferenceConfig(**config, speculative=spec_config))}
    vocab = hf.config.vocab_size
    warm_prompts, warm_params = batch_of(workload, tokenizer, vocab, argparse.Namespace(**{**vars(args), "prompts": 2,
                                                                                          "n": 2}), 10_000)
    # NOTE: what the speculative engine's history holds, mirrored for the ceiling (same tokens either way)
    history = PromptHistory(spec_config.history_samples, spec_config.history_prompts)
    for engine in engines.values():  # untimed: first-call costs
        outs = engine.generate(warm_prompts, warm_params)
    remember(history, warm_prompts, warm_params, [o.generated_token_ids for o in outs])
    for h in range(args.history_rounds):  # untimed: earlier epochs of the same prompts, drafted from later
        prompts, params = batch_of(workload, tokenizer, vocab, args, 20_000 + h)
        outs = engines["spec"].generate(prompts, params)
        remember(history, prompts, params, [o.generated_token_ids for o in outs])
    results: dict[str, list[dict]] = {"plain": [], "spec": []}
    ceilings: dict[str, list[float]] = {kind: [] for kind in CEILINGS}
    same = True
    for r in range(args.repeats):
        prompts, params = batch_of(workload, tokenizer, vocab, args, r)
        order = ("spec", "plain") if r % 2 == 0 else ("plain", "spec")
        got = {name: timed_batch(engines[name], prompts, params) for name in order}
        bounds = ceiling(history, prompts, params, got["plain"]["outputs"], spec_config)
        remember(history, prompts, params, got["plain"]["outputs"])
        for kind, bound in bounds.items():
            ceilings[kind].append(bound)
        if got["spec"]["outputs"] != got["plain"]["outputs"]:
            diff = sum(a != b for a, b in zip(got["spec"]["outputs"], got["plain"]["outputs"]))
            print(f"  round {r}: {diff} of {len(prompts) * (args.n if workload == 'arithmetic' else 1)} samples differ")
            same = False
        for name in order:
            results[name].append(got[name])
        s, p = got["spec"], got["plain"]
        print(f"  round {r}: batch {p['wall']:.2f}s -> {s['wall']:.2f}s, tail {p['tail']:.2f}s -> {s['tail']:.2f}s, "
              f"{p['tokens']} tokens, steps {p['steps']} -> {s['steps']}; tail ceiling "
              + ", ".join(f"{kind} {bound:.2f}x" for kind, bound in bounds.items()), flush=True)
    figures = {}
    for key in ("wall", "tail"):
        figures[f"plain_{key}_s"] = median([x[key] for x in results["plain"]])
        figures[f"spec_{key}_s"] = median([x[key] for x in results["spec"]])
        figures[f"{key}_ratio"] = median([p[key] / s[key] for p, s in zip(results["plain"], results["spec"])])
    proposed = sum(x["spec_proposed_tokens"] for x in results["spec"])
    accepted = sum(x["spec_accepted_tokens"] for x in results["spec"])
    rows = sum(x["spec_rows"] for x in results["spec"])
    figures["acceptance_rate"] = accepted / proposed if proposed else 0.0
    # NOTE: kept tokens against what the proposals' estimated chances expected (1: calibrated)
    expected = sum(x["spec_expected_tokens"] for x in results["spec"])
    figures["kept_over_expected"] = accepted / expected if expected else 0.0
    figures["spec_tokens_per_row"] = (rows + accepted) / rows if rows else 1.0
    for kind, bounds in ceilings.items():
        figures[f"tail_ceiling_{kind}"] = median(bounds)
    for name in ("plain", "spec"):
        figures[f"{name}_tokens_per_step"] = (sum(x["tokens"] for x in results[name])
                                              / sum(x["steps"] for x in results[name]))
    print(f"{choice.description}, {workload}: batch {figures['plain_wall_s']:.2f}s -> {figures['spec_wall_s']:.2f}s "
          f"({figures['wall_ratio']:.2f}x), tail {figures['plain_tail_s']:.2f}s -> {figures['spec_tail_s']:.2f}s "
          f"({figures['tail_ratio']:.2f}x); acceptance {figures['acceptance_rate']:.2f} "
          f"(kept / expected {figures['kept_over_expected']:.2f}), "
          f"{figures['spec_tokens_per_row']:.2f} tokens per speculative row; tokens per step "
          f"{figures['plain_tokens_per_step']:.2f} -> {figures['spec_tokens_per_step']:.2f}; "
          f"outputs {'identical' if same else 'DIFFER'}; the tail's ceiling at free verify steps "
          + ", ".join(f"{kind} {figures[f'tail_ceiling_{kind}']:.2f}x" for kind in CEILINGS), flush=True)
    print_result("speculative_tail", figures, model=model_name, workload=workload, identical=same)
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2", HYBRID.name, "both"], default="both")
    parser.add_argument("--workload", choices=["arithmetic", "random", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--median-len", type=int, default=24)
    parser.add_argument("--spec-tokens", type=int, default=8)
    parser.add_argument("--max-rows", type=int, default=16)
    parser.add_argument("--max-step-tokens", type=int, default=48)
    parser.add_argument("--history-rounds", type=int, default=0,
                        help="untimed batches through the speculative engine first (its prompt history)")
    parser.add_argument("--temperature", type=float, default=0.7, help="arithmetic: the GRPO demo's (0.7)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    print(machine_line())
    models = [TINY.name, SMOLLM2.name] if args.model == "both" else [args.model]
    workloads = ["arithmetic", "random"] if args.workload == "both" else [args.workload]
    ok = True
    for model in models:
        for workload in workloads:
            ok &= run(model, workload, args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
