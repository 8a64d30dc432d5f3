"""Rollout throughput: one GRPO-shaped workload through this engine, HF `generate` and HF continuous batching.

Workload (seeded): `--prompts` prompts of 32-256 random tokens, `--n` samples each, every sample
with its own output length drawn from 16-256. EOS is ignored everywhere, so each engine generates
exactly the tokens asked for (the tokens differ: sampling at temperature 1.0, no top-k/top-p).
tokens/s = useful tokens / wall time, where useful = the tokens each sample was asked for.

* engine: `DynamicInferenceEngine.generate`, one n=1 request per sample with its own `max_tokens`
  (`SamplingParams` has one `max_tokens` for all n samples of a request, see `--engine-fork`).
* engine n=8 fork (`--engine-fork`): one request per prompt with n samples sharing the prefill;
  `max_tokens` = the group's longest sample, the extra tokens are generated but not counted.
* HF generate: per batch of `--hf-batch` prompts (default 8; left-padded; prompts sorted by their group's
  longest sample so a batch wastes little), `num_return_sequences=n`, `max_new_tokens` = the
  batch's longest sample. Every row runs to that length; only the asked-for tokens count.
* HF continuous batching: `model.generate_batch` takes one `max_new_tokens` for all requests, so
  the manager it wraps is used the same way `generate_batch` uses it
  (`continuous_batching_context_manager` + `add_request`), with one request per sample and its
  own `max_new_tokens`. Its KV capacity, step token budget and request cap match the engine's.
  Its one-off set-up and warm-up are left out of the timed wall time (and printed).
Each runner first serves a few short requests untimed (warm-up).

Usage: `python bench/rollout_throughput.py [--model tiny|smollm2|both] [--prompts 64] [--n 8]
[--quick] [--repeats 1] [--threads 2]`. Timings on a shared machine are noisy: the load average
is printed before each run. Exits 1 only if an engine returned other token counts than asked.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads OpenMP; see common.py

import argparse  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from common import DTYPES, MODELS, SMOLLM2, TINY, ModelChoice, hf_model, load_average, machine_line, median  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams  # noqa: E402

BLOCK_SIZE = 16
TARGETS = {TINY.name: 3.0, SMOLLM2.name: 1.5}  # engine / HF generate, from the issue
FIRST_TOKEN = 3  # random prompt tokens avoid the special ids 0-2


@dataclass(frozen=True, slots=True)
class Workload:
    """`prompts[g]` is prompt g; `lengths[g][j]` the output length asked of its sample j."""

    prompts: list[list[int]]
    lengths: list[list[int]]

    @property
    def n(self) -> int:
        return len(self.lengths[0])

    @property
    def useful_tokens(self) -> int:
        return sum(map(sum, self.lengths))

    @property
    def max_total_len(self) -> int:
        return max(len(p) + max(ls) for p, ls in zip(self.prompts, self.lengths))

    def describe(self) -> str:
        plens = [len(p) for p in self.prompts]
        return (
            f"{len(self.prompts)} prompts x n={self.n}, prompt {min(plens)}-{max(plens)} tokens, "
            f"output {min(map(min, self.lengths))}-{max(map(max, self.lengths))} tokens per sample, "
            f"{self.useful_tokens:,} tokens asked for"
        )


def make_workload(
    num_prompts: int, n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(FIRST_TOKEN, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(num_prompts)]
    lengths = [[rng.randint(*output_len) for _ in range(n)] for _ in range(num_prompts)]
    return Workload(prompts, lengths)


@dataclass(slots=True)
class RunResult:
    name: str
    useful_tokens: int
    computed_tokens: int  # tokens sampled, counted or not
    wall_s: float
    load: float  # 1-minute load average when the run started
    ok: bool = True  # every sample got exactly the tokens asked for
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s


@dataclass(frozen=True, slots=True)
class Budget:
    """The serving limits every continuous-batching runner gets alike."""

    kv_tokens: int  # KV cache capacity in tokens
    step_tokens: int  # tokens per forward step
    max_requests: int

    @classmethod
    def for_model(cls, model, kv_gib: float, step_tokens: int, max_requests: int) -> Budget:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * model.dtype.itemsize
        tokens = int(kv_gib * 2**30 // per_token) // 256 * 256  # whole pages of HF's page size too
        return cls(tokens, step_tokens, max_requests)


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


def run_engine(model, work: Workload, budget: Budget) -> RunResult:
    """One n=1 request per sample, each with its own max_tokens."""
    engine = _engine(model, budget)
    prompts = [p for p, ls in zip(work.prompts, work.lengths) for _ in ls]
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for ls in work.lengths for m in ls]
    prefill0, load = engine.context.prefill_tokens, load_average()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    ok = [len(o.generated_token_ids) for o in outputs] == [p.max_tokens for p in params]
    prefill = engine.context.prefill_tokens - prefill0
    unique = sum(map(len, work.prompts))
    note = f"prefilled {prefill:,} prompt tokens ({prefill / unique:.1f}x the {unique:,} distinct ones)"
    return RunResult("engine (n=1 per sample)", work.useful_tokens, work.useful_tokens, wall, load, ok, note)


def run_engine_fork(model, work: Workload, budget: Budget) -> RunResult:
    """One request per prompt with n samples (shared prefill); each runs to the group's longest."""
    engine = _engine(model, budget)
    params = [SamplingParams(n=work.n, temperature=1.0, max_tokens=max(ls), ignore_eos=True) for ls in work.lengths]
    prefill0, load = engine.context.prefill_tokens, load_average()
    start = time.perf_counter()
    outputs = engine.generate(work.prompts, params)
    wall = time.perf_counter() - start
    ok = [len(o.generated_token_ids) for o in outputs] == [p.max_tokens for p in params for _ in range(p.n)]
    computed = sum(p.max_tokens * p.n for p in params)
    prefill = engine.context.prefill_tokens - prefill0
    note = f"group max length, {computed - work.useful_tokens:,} tokens not counted; prefilled {prefill:,}"
    return RunResult(f"engine (n={work.n} fork)", work.useful_tokens, computed, wall, load, ok, note)


# ---- HF transformers -----------------------------------------------------------------------------


def _pad_id(model) -> int:
    pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)


@torch.no_grad()
def run_hf_generate(model, work: Workload, prompts_per_batch: int) -> RunResult:
    """Left-padded batches of prompts, n return sequences each, all rows to the batch's longest."""
    pad = _pad_id(model)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=pad)

    def generate(groups: list[int]) -> tuple[int, bool]:
        prompts = [work.prompts[g] for g in groups]
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(max(work.lengths[g]) for g in groups)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, num_return_sequences=work.n, **kwargs
        )
        return out.shape[0] * new, out.shape == (len(prompts) * work.n, width + new)

    generate([0])  # warm-up
    order = sorted(range(len(work.prompts)), key=lambda g: max(work.lengths[g]), reverse=True)
    batches = [order[i : i + prompts_per_batch] for i in range(0, len(order), prompts_per_batch)]
    computed, ok, load = 0, True, load_average()
    start = time.perf_counter()
    for groups in batches:
        tokens, shape_ok = generate(groups)
        computed += tokens
        ok &= shape_ok
    wall = time.perf_counter() - start
    note = f"{prompts_per_batch} prompts/batch, {computed - work.useful_tokens:,} padded tokens not counted"
    return RunResult("HF generate (padded)", work.useful_tokens, computed, wall, load, ok, note)


@torch.no_grad()
def run_hf_continuous(model, work: Workload, budget: Budget) -> RunResult:
    """HF continuous batching through the manager `generate_batch` wraps: per-request max_new_tokens."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    pad = _pad_id(model)
    longest = max(map(max, work.lengths))
    gen = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=-1, pad_token_id=pad,
        max_new_tokens=longest, num_return_sequences=1,
    )  # fmt: skip
    page = 256
    cb = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=budget.kv_tokens // page,
        max_batch_tokens=budget.step_tokens,
        max_requests_per_batch=budget.max_requests,
    )
    hints = WorkloadHints(
        max_prompt_length=max(map(len, work.prompts)),
        max_generated_length=longest,
        num_requests=len(work.prompts) * work.n,
    )
    setup = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30, workload_hints=hints
    ) as manager:
        setup_s = time.perf_counter() - setup
        _drain(manager, {manager.add_request([FIRST_TOKEN + i] * 40, max_new_tokens=4): 4 for i in range(4)})
        load = load_average()
        start = time.perf_counter()
        asked = {}
        for prompt, lengths in zip(work.prompts, work.lengths):
            for length in lengths:
                asked[manager.add_request(prompt, max_new_tokens=length)] = length
        ok, error = _drain(manager, asked)
        wall = time.perf_counter() - start
    note = f"set-up + warm-up {setup_s:.1f} s not timed"
    if error:
        note += f"; {error}"
    return RunResult("HF continuous batching", work.useful_tokens, work.useful_tokens, wall, load, ok, note)


def _drain(manager, asked: dict[str, int], timeout_s: float = 600.0) -> tuple[bool, str]:
    """Wait for every request in `asked`; (all got exactly their tokens, first error if any)."""
    pending, ok, error = set(asked), True, ""
    while pending:
        result = manager.get_result(timeout=timeout_s)
        if result is None:
            return False, f"no result within {timeout_s:.0f} s ({len(pending)} pending)"
        if not result.is_finished() or result.request_id not in pending:
            continue
        pending.discard(result.request_id)
        if result.error is not None:
            ok, error = False, error or f"request failed: {result.error}"
        ok &= len(result.generated_tokens) == asked[result.request_id]
    return ok, error


# ---- driver --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Runner:
    key: str
    run: Callable[[], RunResult]


def bench_model(choice: ModelChoice, args: argparse.Namespace) -> list[RunResult]:
    dtype = DTYPES[args.dtype]
    model = hf_model(choice, dtype)
    vocab = model.config.vocab_size
    work = make_workload(args.prompts, args.n, args.prompt_len, args.output_len, vocab, args.seed)
    budget = Budget.for_model(model, args.kv_gib, args.step_tokens, args.max_requests)
    print(f"\n== {choice.name}: {choice.description}, {args.dtype}")
    print(f"workload: {work.describe()}")
    print(
        f"serving limits (engine and HF continuous batching): KV {budget.kv_tokens:,} tokens, "
        f"{budget.step_tokens} tokens/step, {budget.max_requests} requests"
    )
    runners = [Runner("engine", lambda: run_engine(model, work, budget))]
    if args.engine_fork:
        runners.append(Runner("engine-fork", lambda: run_engine_fork(model, work, budget)))
    runners.append(Runner("hf-generate", lambda: run_hf_generate(model, work, args.hf_batch)))
    if not args.no_hf_continuous:
        runners.append(Runner("hf-continuous", lambda: run_hf_continuous(model, work, budget)))

    runs: dict[str, list[RunResult]] = {r.key: [] for r in runners}
    skipped: dict[str, str] = {}
    for _ in range(args.repeats):  # NOTE: repeats interleave the runners, so load drifts hit all alike
        for runner in runners:
            if runner.key in skipped:
                continue
            try:
                result = runner.run()
            except Exception as error:  # an HF path unusable here is reported and skipped, not fatal
                if runner.key == "engine":
                    raise
                skipped[runner.key] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                continue
            runs[runner.key].append(result)
            print(
                f"  {result.name:<26} {result.wall_s:8.1f} s  {result.tokens_per_s:8.1f} tok/s  "
                f"load {result.load:.2f}{'' if result.ok else '  TOKEN COUNTS WRONG'}",
                flush=True,
            )
    results = [_median_run(rs) for rs in runs.values() if rs]
    _print_table(choice, results, skipped, args.repeats)
    return results


def _median_run(runs: list[RunResult]) -> RunResult:
    ranked = sorted(runs, key=lambda r: r.wall_s)
    mid = ranked[len(ranked) // 2]
    mid.ok = all(r.ok for r in runs)
    mid.wall_s = median([r.wall_s for r in runs])
    return mid


def _print_table(choice: ModelChoice, results: list[RunResult], skipped: dict[str, str], repeats: int) -> None:
    by_name = {r.name: r for r in results}
    engine = results[0]
    hf = by_name.get("HF generate (padded)")
    header = (
        f"{'':<26} {'useful tok':>10} {'sampled tok':>11} {'wall s':>8} {'useful tok/s':>12} {'engine/this':>11}  notes"
    )
    print(f"-- {choice.name}: median of {repeats} run(s); tok/s = useful tokens / wall time")
    print(header)
    print("-" * len(header))
    for r in results:
        ratio = engine.tokens_per_s / r.tokens_per_s
        flag = "" if r.ok else " [TOKEN COUNTS WRONG]"
        print(
            f"{r.name:<26} {r.useful_tokens:>10,} {r.computed_tokens:>11,} {r.wall_s:>8.1f} "
            f"{r.tokens_per_s:>12.1f} {ratio:>10.2f}x  {r.note}{flag}"
        )
    for key, reason in skipped.items():
        print(f"{key:<26} skipped: {reason}")
    if hf is not None:
        ratio = engine.tokens_per_s / hf.tokens_per_s
        target = TARGETS[choice.name]
        print(
            f"engine / HF generate on {choice.name}: {ratio:.2f}x "
            f"(target >= {target:g}x: {'met' if ratio >= target else 'NOT met'})"
        )


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--prompts", type=int, default=None, help="prompts (default 64; --quick 8)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=_range, default=None, help="LOW-HIGH (default 32-256)")
    parser.add_argument("--output-len", type=_range, default=None, help="LOW-HIGH per sample (default 16-256)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 8 prompts x n=4, short outputs")
    parser.add_argument("--repeats", type=int, default=1, help="runs per engine, interleaved; median reported")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--hf-batch", type=int, default=8, help="prompts per HF generate call (8-16 were fastest)")
    parser.add_argument("--kv-gib", type=float, default=2.0, help="KV cache size of the continuous batchers")
    parser.add_argument("--step-tokens", type=int, default=2048, help="tokens per step of the continuous batchers")
    parser.add_argument("--max-requests", type=int, default=256, help="requests in flight, continuous batchers")
    parser.add_argument("--engine-fork", action="store_true", help="also run the engine with n samples per request")
    parser.add_argument("--no-hf-continuous", action="store_true", help="skip HF continuous batching")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.model = "tiny" if args.model == "both" else args.model
        args.prompts = args.prompts or 8
        args.n = 4 if args.n == 8 else args.n
        args.prompt_len = args.prompt_len or (32, 64)
        args.output_len = args.output_len or (8, 32)
        args.kv_gib = min(args.kv_gib, 0.25)
    args.prompts = args.prompts or 64
    args.prompt_len = args.prompt_len or (32, 256)
    args.output_len = args.output_len or (16, 256)
    if min(args.prompts, args.n, args.repeats, args.threads, args.hf_batch) < 1:
        parser.error("--prompts, --n, --repeats, --threads and --hf-batch must be >= 1")

    transformers_logging.set_verbosity_error()  # NOTE: CB warns at every set-up; errors still show
    transformers_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print(f"rollout throughput, temperature 1.0, EOS ignored; {machine_line()}")
    choices = list(MODELS.values()) if args.model == "both" else [MODELS[args.model]]
    all_ok = True
    for choice in choices:
        for result in bench_model(choice, args):
            all_ok &= result.ok
    print(f"done; {machine_line()}")
    if not all_ok:
        print("ERROR: an engine returned other token counts than asked for", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
