"""Rollout throughput: one GRPO-shaped workload through this engine and HF transformers at its best.

Workload (seeded): `--prompts` prompts of 32-256 random tokens, `--n` samples each, every sample
asked for its own length (its target) drawn from 16-256 (`--group-lengths`: one per prompt, shared
by its n samples); temperature 1.0, no top-k/top-p.
tokens/s = useful tokens / wall time, useful = the targets summed. What each side is told:

* engine: one n=1 request per sample, `max_tokens` = its target (`ignore_eos`). The engine has no
  logits-processor hook; this is the same per-sample stop HF `generate` gets below.
* engine n-fork (`--engine-fork`): one request per prompt with n samples sharing the prefill;
  `max_tokens` = the group's longest target (one `max_tokens` per request), extras not counted.
* HF generate: `ForceEosAtLength` bans EOS before each row's target and forces it as the
  target-th token, `max_new_tokens` = the shared upper bound (`--output-len` high). Finished rows
  are padded as HF does, until the call's last row finishes. Prompts are sorted by their group's
  longest target so a call wastes little. Swept: prompts per call (`--hf-batch`, default 1, 2,
  4, ... and all) x prefill (`repeat`: `num_return_sequences=n`; `once`: prefill each prompt once
  and expand the DynamicCache n-fold); and, unless `--no-hf-static`, `repeat` with a static KV cache
  and the decode step compiled by HF's own `CompileConfig` (inductor on CPU; compiled in an untimed
  warm-up per call size, every call's prompts padded to the longest so the shapes repeat).
* HF continuous batching: one request per sample, `max_new_tokens` = its target (as the engine);
  KV capacity, step tokens and request cap are the engine's; page size swept (`--cb-pages`, 16
  is ours). Its set-up and warm-up are untimed (printed).

Each run builds a fresh engine (no prefix cache carries over) and serves a few short requests
untimed first. `--repeats` (default 3) interleave every configuration. In the first (the sweep),
an HF generate configuration still running after `--give-up` (2) x its family's fastest wall
time so far is stopped (printed as bounds: wall >, tok/s <); after it, peer configurations
stopped or under `--prune` (0.6) x the best peer configuration are printed from that run and
not rerun (each family's best is kept). The headline is the median over repeats of engine
tok/s / the best peer configuration's tok/s, the best being the one with the highest median.
Then the share of the machine's matmul rate each side reaches (see `flop_share.py`: useful FLOPs
/ wall time against the rate of the model's own GEMM shapes, measured once per repeat), and the
roofline of a decode step at the engine's fullest batch (its FLOPs and least bytes read, against
that rate and the memory bandwidth, also measured once per repeat).

Usage: `python bench/throughput/rollout_throughput.py [--model tiny|smollm2|both] [--prompts 64] [--n 8]
[--quick] [--repeats 3] [--hf-batch 1,8] [--cb-pages 16,256] [--threads 2]`. Prints one
`RESULT {json}` line per model. Exits 1 if any runner returned other token counts than asked.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads OpenMP; see common.py

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

from bench.common import (  # noqa: E402
    DTYPES,
    MODELS,
    SMOLLM2,
    TINY,
    ModelChoice,
    hf_model,
    load_average,
    machine_line,
    median,
    print_result,
)
from bench.throughput.flop_share import (  # noqa: E402
    PROBE_BATCHES,
    DecodeStep,
    MatmulProbe,
    ProbeRate,
    mean_context,
    memory_bandwidth,
    useful_flops,
)
from bench.throughput.hf_peers import GenerateConfig, Prefill, run_continuous, run_generate  # noqa: E402
from bench.throughput.rollout_workload import FIRST_TOKEN, Budget, RunResult, Workload, make_workload  # noqa: E402
from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams  # noqa: E402

BLOCK_SIZE = 16
TARGETS = {TINY.name: 3.0, SMOLLM2.name: 2.0}  # engine / HF, from the issue
CB_PAGES = (16, 32, 64, 128, 256)


# ---- this engine ---------------------------------------------------------------------------------


def _engine(model, budget: Budget) -> DynamicInferenceEngine:
    config = InferenceConfig(
        block_size=BLOCK_SIZE,
        num_blocks=budget.kv_tokens // BLOCK_SIZE,
        max_requests=budget.max_requests,
        max_batch_tokens=budget.step_tokens,
        dtype=model.dtype,
    )
    engine = DynamicInferenceEngine.from_pretrained(model, config, share_weights=True)
    warm = [[FIRST_TOKEN + i] * 40 for i in range(4)]
    engine.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
    return engine


def _timed_generate(engine: DynamicInferenceEngine, prompts, params) -> tuple[list, float, int, float]:
    """(outputs, wall s, prompt tokens prefilled, load when it started)."""
    prefill0, load = engine.context.prefill_tokens, load_average()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    return outputs, wall, engine.context.prefill_tokens - prefill0, load


def run_engine(model, work: Workload, budget: Budget) -> RunResult:
    """One n=1 request per sample, `max_tokens` = its target."""
    engine = _engine(model, budget)
    prompts = [p for p, ls in zip(work.prompts, work.lengths) for _ in ls]
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for ls in work.lengths for m in ls]
    outputs, wall, prefill, load = _timed_generate(engine, prompts, params)
    ok = [len(o.generated_token_ids) for o in outputs] == [p.max_tokens for p in params]
    unique = sum(map(len, work.prompts))
    note = f"n=1 per sample; {prefill / unique:.1f}x the {unique:,} distinct prompt tokens prefilled"
    return RunResult("engine", "engine", work.useful_tokens, work.useful_tokens, prefill, wall, load, ok, note)


def run_engine_fork(model, work: Workload, budget: Budget) -> RunResult:
    """One request per prompt with n samples (shared prefill); each runs to the group's longest."""
    engine = _engine(model, budget)
    params = [SamplingParams(n=work.n, temperature=1.0, max_tokens=max(ls), ignore_eos=True) for ls in work.lengths]
    outputs, wall, prefill, load = _timed_generate(engine, work.prompts, params)
    ok = [len(o.generated_token_ids) for o in outputs] == [p.max_tokens for p in params for _ in range(p.n)]
    sampled = sum(p.max_tokens * p.n for p in params)
    note = f"n={work.n} per request, all to the group's longest target"
    return RunResult("engine n-fork", "engine", work.useful_tokens, sampled, prefill, wall, load, ok, note)


# ---- driver --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Runner:
    """One configuration; `run(give_up_s)` may stop part-way after `give_up_s` (HF generate only)."""

    key: str
    family: str
    run: Callable[[float | None], RunResult]


def _runners(model, work: Workload, budget: Budget, args: argparse.Namespace) -> list[Runner]:
    runners = [Runner("engine", "engine", lambda _: run_engine(model, work, budget))]
    if args.engine_fork:
        runners.append(Runner("engine n-fork", "engine", lambda _: run_engine_fork(model, work, budget)))
    per_call = args.hf_batch or _powers_of_two_and_all(len(work.prompts))
    forms = [(prefill, False) for prefill in args.hf_prefill]
    if not args.no_hf_static:  # NOTE: a static cache is not expanded from a prefilled one (hf_peers.GenerateConfig)
        forms.append((Prefill.REPEAT, True))
    for prefill, static in forms:
        # NOTE: largest calls first: they are likely the fastest, and set the bar for `--give-up`
        for size in sorted({min(s, len(work.prompts)) for s in per_call}, reverse=True):
            config = GenerateConfig(size, prefill, static)
            runners.append(Runner(config.key, "hf-generate", lambda g, c=config: run_generate(model, work, c, g)))
    for page in args.cb_pages:
        run = lambda _, p=page: run_continuous(model, work, budget, p)  # noqa: E731
        runners.append(Runner(f"hf-continuous page {page}", "hf-continuous", run))
    return runners


def _powers_of_two_and_all(count: int) -> list[int]:
    sizes, size = [], 1
    while size < count:
        sizes.append(size)
        size *= 2
    return [*sizes, count]


def bench_model(choice: ModelChoice, args: argparse.Namespace) -> list[RunResult]:
    model = hf_model(choice, DTYPES[args.dtype])
    work = make_workload(args.prompts, args.n, args.prompt_len, args.output_len, model.config.vocab_size, args.seed,
                         group_lengths=args.group_lengths)
    budget = Budget.for_workload(model, work, args.kv_gib, args.step_tokens, args.max_requests)
    print(f"\n== {choice.name}: {choice.description}, {args.dtype}")
    print(f"workload: {work.describe()}")
    print(
        f"serving limits (engine and HF continuous batching): KV {budget.kv_tokens:,} tokens, "
        f"{budget.step_tokens} tokens/step, {budget.max_requests} requests"
    )
    runners = _runners(model, work, budget, args)
    runs: dict[str, list[RunResult]] = {r.key: [] for r in runners}
    skipped: dict[str, str] = {}
    pruned: set[str] = set()
    rate_batch = min(budget.max_requests, work.n * len(work.prompts))  # the engine's fullest decode batch
    probe = MatmulProbe(model.config, {*PROBE_BATCHES, rate_batch}, DTYPES[args.dtype])
    rates: list[ProbeRate] = []
    bandwidths: list[tuple[float, float]] = []
    for repeat in range(args.repeats):  # NOTE: repeats interleave the runners, so load drifts hit all alike
        rates.append(probe.rate())
        bandwidths.append(memory_bandwidth())
        for runner in runners:
            if runner.key in skipped or runner.key in pruned:
                continue
            # NOTE: only the first repeat (the sweep) gives up on a configuration; later ones run in full
            fastest = [rs[0].wall_s for rs in runs.values() if rs and rs[0].family == runner.family]
            give_up = args.give_up * min(fastest) if repeat == 0 and args.give_up > 0 and fastest else None
            try:
                result = runner.run(give_up)
            except Exception as error:  # a peer configuration unusable here is reported and skipped
                if runner.key == "engine":
                    raise
                skipped[runner.key] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                print(f"  [{repeat + 1}] {runner.key:<28} skipped: {skipped[runner.key]}", flush=True)
                continue
            runs[runner.key].append(result)
            stopped = f"  STOPPED (> {args.give_up:g}x the family's fastest)" if result.stopped else ""
            print(
                f"  [{repeat + 1}] {result.key:<28} {result.wall_s:8.1f} s {result.tokens_per_s:8.1f} tok/s  "
                f"load {result.load:.2f}{'' if result.ok else '  TOKEN COUNTS WRONG'}{stopped}",
                flush=True,
            )
        if repeat == 0 and args.repeats > 1 and args.prune > 0:
            pruned = _prune(runs, args.prune)
            if pruned:
                print(f"  pruned after repeat 1 (stopped, or < {args.prune:g}x the best): {', '.join(sorted(pruned))}")
    for key in skipped:  # NOTE: a configuration that failed in a later repeat has unequal runs: drop it
        runs[key] = []
    _report(choice, runs, skipped, args.repeats)
    _report_flop_share(choice, runs, useful_flops(model.config, work), rates)
    rate = median([r.flops_per_s for r in rates])
    step = DecodeStep.of(model.config, rate_batch, mean_context(work), DTYPES[args.dtype])
    _report_roofline(choice, runs, step, rate, median([b[0] for b in bandwidths]),
                     median([b[1] for b in bandwidths]), useful_flops(model.config, work))
    return [r for rs in runs.values() for r in rs]


def _prune(runs: dict[str, list[RunResult]], factor: float) -> set[str]:
    """Peer configurations whose first run was stopped or under `factor` x the best first run of
    all peers (so of their family too); each family's best is kept, and reported from every repeat.

    NOTE: the sweep's slow corners (1 prompt per `generate` call; continuous batching on CPU) take
    many times the best's wall time; they cannot win, and rerunning them would triple the run.
    """
    firsts = [rs[0] for rs in runs.values() if rs and rs[0].family != "engine"]
    best: dict[str, RunResult] = {}
    for r in firsts:
        if not r.stopped and (r.family not in best or r.tokens_per_s > best[r.family].tokens_per_s):
            best[r.family] = r
    bar = factor * max((r.tokens_per_s for r in best.values()), default=0.0)
    keep = {r.key for r in best.values()}
    return {r.key for r in firsts if r.key not in keep and (r.stopped or r.tokens_per_s < bar)}


def _report(choice: ModelChoice, runs: dict[str, list[RunResult]], skipped: dict[str, str], repeats: int) -> None:
    med = {key: median([r.tokens_per_s for r in rs]) for key, rs in runs.items() if rs}
    engine = med["engine"]
    print(
        f"-- {choice.name}: medians of {repeats} interleaved run(s); tok/s = useful tokens / wall time; "
        "engine/this = ratio of the medians"
    )
    header = (
        f"{'configuration':<28} {'useful tok':>10} {'prefill tok':>11} {'sampled tok':>11} {'wall s':>7} "
        f"{'tok/s':>8} {'engine/this':>11}  notes"
    )
    print(header)
    print("-" * len(header))
    for key, rs in runs.items():
        if not rs:
            continue
        first = rs[0]
        prefill = f"{first.prefill_tokens:,}" if first.prefill_tokens >= 0 else "n/a"
        flag = "" if all(r.ok for r in rs) else " [TOKEN COUNTS WRONG]"
        flag += "" if len(rs) == len(runs["engine"]) else f" [{len(rs)} run: pruned]"
        more, less = (">", "<") if first.stopped else ("", "")  # NOTE: a stopped run bounds its figures
        wall, tok_s, ratio = median([r.wall_s for r in rs]), med[key], engine / med[key]
        print(
            f"{key:<28} {first.useful_tokens:>10,} {prefill:>11} {first.sampled_tokens:>11,} "
            f"{more + f'{wall:.1f}':>7} {less + f'{tok_s:.1f}':>8} {more + f'{ratio:.2f}':>10}x  {first.note}{flag}"
        )
    for key, reason in skipped.items():
        print(f"{key:<28} skipped: {reason}")
    complete = len(runs["engine"])  # NOTE: pruned configurations ran once and cannot be the best
    peers = {k: tok_s for k, tok_s in med.items() if runs[k][0].family != "engine" and len(runs[k]) == complete}
    if not peers:
        print_result("rollout_throughput", {f"engine_tok_s[{choice.name}]": engine}, model=choice.name)
        return
    figures = {f"engine_tok_s[{choice.name}]": engine}
    for family in ("hf-generate", "hf-continuous"):
        keys = [k for k in peers if runs[k][0].family == family]
        if keys:
            best = max(keys, key=peers.get)
            ratio = _paired_ratio(runs["engine"], runs[best])
            figures[f"engine/{family}_best[{choice.name}]"] = ratio
            print(f"best {family}: {best} at {peers[best]:.1f} tok/s; engine / it: {ratio:.2f}x")
    best = max(peers, key=peers.get)
    ratio = _paired_ratio(runs["engine"], runs[best])
    figures[f"peer_best_tok_s[{choice.name}]"] = peers[best]
    figures[f"engine/peer_best[{choice.name}]"] = ratio
    target = TARGETS[choice.name]
    print(
        f"engine / HF at its best ({best}) on {choice.name}: {ratio:.2f}x, median of {len(runs[best])} "
        f"per-repeat ratios (target >= {target:g}x: {'met' if ratio >= target else 'NOT met'})"
    )
    print_result("rollout_throughput", figures, model=choice.name, peer_best=best)


def _report_flop_share(choice: ModelChoice, runs: dict[str, list[RunResult]], flops: float,
                       rates: list[ProbeRate]) -> None:
    """Useful GFLOP/s of the engine and of each family's best peer against the measured matmul rate."""
    rate = median([r.flops_per_s for r in rates])
    where = ", ".join(f"{r.form} at {r.batch} rows {r.flops_per_s / 1e9:.1f}" for r in rates)
    print(
        f"-- {choice.name}: share of the machine's matmul rate ({rate / 1e9:.1f} GFLOP/s on the model's GEMM "
        f"shapes, the median over repeats of the fastest form and batch size: {where}); useful work "
        f"{flops / 1e9:.1f} GFLOP"
    )
    shown = {"engine": runs["engine"]}
    for family in ("hf-generate", "hf-continuous"):
        full = {k: rs for k, rs in runs.items() if rs and rs[0].family == family and len(rs) == len(runs["engine"])}
        if full:
            best = max(full, key=lambda k: median([r.tokens_per_s for r in full[k]]))
            shown[best] = full[best]
    figures = {}
    for key, rs in shown.items():
        achieved = flops / median([r.wall_s for r in rs])
        print(f"{key:<28} {achieved / 1e9:8.1f} GFLOP/s useful = {achieved / rate:6.1%} of the matmul rate")
        if key == "engine":
            figures[f"flop_share[{choice.name}]"] = achieved / rate
    print_result("rollout_throughput_flops", figures, model=choice.name, matmul_gflops=rate / 1e9)


def _report_roofline(choice: ModelChoice, runs: dict[str, list[RunResult]], step: DecodeStep, rate: float,
                     read_bw: float, copy_bw: float, flops: float) -> None:
    """A decode step at the engine's fullest batch against the machine's matmul rate and bandwidth."""
    ridge = rate / read_bw
    bound = min(rate, step.intensity * read_bw)
    achieved = flops / median([r.wall_s for r in runs["engine"]])
    print(
        f"-- {choice.name}: roofline of a decode step at {step.batch} rows, mean context {step.context:.0f}: "
        f"{step.flops / 1e9:.2f} GFLOP, {step.bytes / 1e6:.1f} MB read at least (weights "
        f"{step.weight_bytes / 1e6:.1f} + KV {step.kv_bytes / 1e6:.1f}), intensity {step.intensity:.1f} FLOP/B; "
        f"machine: matmul {rate / 1e9:.1f} GFLOP/s, memory {read_bw / 1e9:.1f} GB/s read ({copy_bw / 1e9:.1f} "
        f"copy), ridge {ridge:.1f} FLOP/B: {'compute' if step.intensity >= ridge else 'memory'}-bound, roof "
        f"{bound / 1e9:.1f} GFLOP/s; engine {achieved / 1e9:.1f} GFLOP/s useful = {achieved / bound:.1%} of it"
    )
    print_result("rollout_throughput_roofline", {
        f"step_gflop[{choice.name}]": step.flops / 1e9, f"step_mb[{choice.name}]": step.bytes / 1e6,
        f"intensity[{choice.name}]": step.intensity, f"read_gbs[{choice.name}]": read_bw / 1e9,
        f"copy_gbs[{choice.name}]": copy_bw / 1e9, f"ridge[{choice.name}]": ridge,
        f"engine/roof[{choice.name}]": achieved / bound}, model=choice.name, batch=step.batch)


def _paired_ratio(engine: list[RunResult], peer: list[RunResult]) -> float:
    """Median over repeats of engine tok/s / peer tok/s, each pair from the same repeat."""
    return median([e.tokens_per_s / p.tokens_per_s for e, p in zip(engine, peer)])


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def _ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if min(values, default=0) < 1 and values:
        raise argparse.ArgumentTypeError(f"expected ints >= 1, got {text!r}")
    return values


def _prefills(text: str) -> list[Prefill]:
    try:
        return [Prefill(s.strip()) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected repeat and/or once, got {text!r}") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--prompts", type=int, default=None, help="prompts (default 64; --quick 8)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=_range, default=None, help="LOW-HIGH (default 32-256)")
    parser.add_argument("--output-len", type=_range, default=None, help="LOW-HIGH per sample (default 16-256)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 8 prompts x n=4, short "
                        "outputs, 1 and 8 prompts per HF call, pages 16 and 256")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=None, help="interleaved runs of each (default 3; --quick 2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--hf-batch", type=_ints, default=None, help="prompts per HF generate call, e.g. 1,8 "
                        "(default: 1, 2, 4, ... and all)")  # fmt: skip
    parser.add_argument("--hf-prefill", type=_prefills, default=list(Prefill), help="repeat,once (default both)")
    parser.add_argument("--cb-pages", type=_ints, default=None, help="HF continuous batching page sizes "
                        "(default 16,32,64,128,256; --quick 16,256)")  # fmt: skip
    parser.add_argument("--kv-gib", type=float, default=2.0, help="KV cap of the continuous batchers")
    parser.add_argument("--step-tokens", type=int, default=2048, help="tokens per step of the continuous batchers")
    parser.add_argument("--max-requests", type=int, default=256, help="requests in flight, continuous batchers")
    parser.add_argument("--engine-fork", action="store_true", help="also run the engine with n samples per request")
    parser.add_argument("--no-hf-continuous", action="store_true", help="skip HF continuous batching")
    parser.add_argument("--no-hf-static", action="store_true", help="skip HF generate with a static cache and "
                        "its decode step compiled (torch.compile, inductor)")  # fmt: skip
    parser.add_argument("--group-lengths", action="store_true", help="the n samples of a prompt share one length "
                        "(HF generate's padding within a group then wastes nothing)")  # fmt: skip
    parser.add_argument("--give-up", type=float, default=2.0, help="in repeat 1, stop an HF generate configuration "
                        "after this x its family's fastest wall time so far (0: never)")  # fmt: skip
    parser.add_argument("--prune", type=float, default=0.6, help="after repeat 1, drop peer configurations under "
                        "this x the best peer configuration, keeping each family's best (0: keep all)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.model = "tiny" if args.model == "both" else args.model
        args.prompts = args.prompts or 8
        args.n = 4 if args.n == 8 else args.n
        args.prompt_len = args.prompt_len or (32, 64)
        args.output_len = args.output_len or (8, 32)
        args.repeats = args.repeats or 2
        args.hf_batch = args.hf_batch or [1, args.prompts]
        args.cb_pages = args.cb_pages or [16, 256]
    args.prompts = args.prompts or 64
    args.prompt_len = args.prompt_len or (32, 256)
    args.output_len = args.output_len or (16, 256)
    args.repeats = args.repeats or 3
    args.cb_pages = args.cb_pages or list(CB_PAGES)
    if args.no_hf_continuous:
        args.cb_pages = []
    if min(args.prompts, args.n, args.repeats, args.threads) < 1:
        parser.error("--prompts, --n, --repeats and --threads must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    transformers_logging.set_verbosity_error()  # NOTE: CB warns at every set-up; errors still show
    transformers_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    # NOTE: the static-cache peer compiles one graph per call size of the sweep; past dynamo's default of
    # 8 graphs a function falls back to eager, which would misreport the compiled peer
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    print(f"rollout throughput, temperature 1.0, every sample told its length; {machine_line()}")
    choices = list(MODELS.values()) if args.model == "both" else [MODELS[args.model]]
    all_ok = True
    for choice in choices:
        for result in bench_model(choice, args):
            all_ok &= result.ok
    print(f"done; {machine_line()}")
    if not all_ok:
        print("ERROR: a runner returned other token counts than asked for", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
