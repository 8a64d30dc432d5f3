"""Engine time per decode step outside the model forward, at 16, 64 and 256 active requests.

For each batch size B an engine on SmolLM2-135M's spec holds B requests (`--prompt-len` random
tokens each, EOS ignored, temperature 1.0), all decoding. Two kinds of steps are timed:

* stand-in model: the real model (spec, cache specs, backend) but a forward that returns rows of a preallocated
  `[max_requests, vocab]` logits tensor at once, so the step time is the engine's own cost
  (schedule + batch build + sampling + bookkeeping). Each phase is timed by wrapping it.
* real model: the same engine with the real SmolLM2 decoder swapped in for the stand-in (the
  prefill ran on the stand-in, so the KV holds zeros: the cost of attention is that of real
  context lengths, the values do not matter). Its forward is timed by wrapping it, and the rest
  of the step is the overhead measured in place.

Printed per B: each phase of the stand-in step, the stand-in step (= overhead) and its
bookkeeping (the step less sampling), each as the median over every 16 consecutive steps of their
mean (`window_median`: a block fills once in 16 steps, so registering it is a cost of some steps);
the real forward (median), and overhead / forward (the headline: the engine's own cost against its
peer, the model forward, in the same run); beside each per-step figure, the same per active request
(step / B, in us), which is what grows if bookkeeping is not vectorised. `--profile` prints
cProfile's top functions of the stand-in steps at the largest B (cProfile slows Python code,
so read it for shares, not times).

`--processors` instead times vLLM's logit processors and structured outputs: per B, three stand-in
engines hold B requests each: plain ("off"); with repetition / presence / frequency penalties, 16
logit_bias entries and 4 bad words (1 to 3 tokens) on every request ("proc"); and with all of
those plus a JSON schema grammar on every request ("all": an array of at least 100 objects, so
that no grammar ends inside the timed steps; each request's matcher walks its own random JSON,
the stand-in's logits under the mask). Their steps are timed in interleaved runs of `PROC_CHUNK`
steps (so load drifts hit all alike), and the medians and the ratios against "off" are printed
with the sampling phases beside them. The processors are batched tensor ops and the grammar masks
are filled for all rows at once (llguidance's thread pool): their cost per request is a few
passes over its logits row, not Python per request.

Usage: `python bench/throughput/step_overhead.py [--batches 16,64,256] [--steps 40] [--real-steps 5]
[--quick] [--threads 2] [--profile] [--processors]`.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads OpenMP; see common.py

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import pstats  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import inference.core.engine_core as core_module  # noqa: E402
import inference.core.outputs as out_ops  # noqa: E402
from bench.common import DTYPES, Stopwatch, load_average, machine_line, median, print_result  # noqa: E402
from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams  # noqa: E402
from inference.models.loading import load_from_hf_dir  # noqa: E402
from inference.models.smollm2 import smollm2_dir  # noqa: E402

BLOCK_SIZE = 16
MAX_REQUESTS = 256
STEP_TOKENS = 2048  # tokens per engine step (the engine's default)
# phases wrapped in the engine's step, in step order; "other" is the step minus all of them
ORIGINAL_REGISTER = core_module.register_full_blocks
ORIGINAL_SAMPLING_BATCH = out_ops.sampling_batch
PROC_CHUNK = 4  # stand-in steps per turn of one engine in the --processors comparison
PROC_BIAS = 16  # logit_bias entries per request there
PROC_ARMS = ("off", "proc", "all")  # plain; penalties + bias + bad words; those and a grammar
# the grammar of the "all" arm: JSON that cannot end within the timed steps (>= 100 objects)
PROC_SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "score": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
    "required": ["name", "score", "tags"], "additionalProperties": False}}
PHASES = ("schedule", "build_batch", "forward", "fork_groups", "register_blocks", "sampling_batch", "sample", "commit")


class InstantLogits:
    """Stand-in decoder: the real model in every respect but a forward that costs nothing.

    Invariant: `forward` returns a view of the first `len(logits_indices)` rows of one
    preallocated `[max_rows, vocab]` tensor in the model's dtype (random values, fixed once);
    everything else (`spec`, `cache_specs`, `backend`, weights) is the real model's.
    """

    def __init__(self, model, max_rows: int) -> None:
        self._model = model
        generator = torch.Generator().manual_seed(0)
        self._logits = torch.randn(max_rows, model.spec.vocab_size, generator=generator).to(model.spec.dtype)

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def forward(self, input_ids, positions, kv_cache, meta, logits_indices, *, states=None) -> torch.Tensor:
        return self._logits[: logits_indices.shape[0]]


@dataclass(slots=True)
class BatchResult:
    batch: int
    context: int  # median context length of the timed real steps
    stub_step_s: float
    stub_phases: dict[str, float]
    rest_s: float  # step - sampling (the step's own bookkeeping), window_median over the stand-in steps
    real_step_s: float
    forward_s: float
    load: float

    @property
    def overhead_s(self) -> float:
        return self.stub_step_s

    @property
    def in_place_overhead_s(self) -> float:
        return self.real_step_s - self.forward_s


def _instrument(engine: DynamicInferenceEngine, clock: Stopwatch) -> None:
    """Wrap the step's phases so that each call adds its time to `clock` (undone by `_restore`)."""
    core = engine.core
    core.scheduler.schedule = clock.wrap("schedule", core.scheduler.schedule)
    core.runner.prepare = clock.wrap("build_batch", core.runner.prepare)
    core.runner.forward = clock.wrap("forward", core.runner.forward)
    core.scheduler.fork_groups = clock.wrap("fork_groups", core.scheduler.fork_groups)
    core_module.register_full_blocks = clock.wrap("register_blocks", ORIGINAL_REGISTER)
    out_ops.sampling_batch = clock.wrap("sampling_batch", ORIGINAL_SAMPLING_BATCH)
    core.runner.sample = clock.wrap("sample", core.runner.sample)
    core.commit_tokens = clock.wrap("commit", core.commit_tokens)


def _restore() -> None:
    core_module.register_full_blocks = ORIGINAL_REGISTER
    out_ops.sampling_batch = ORIGINAL_SAMPLING_BATCH


def _decode_ready(engine: DynamicInferenceEngine, batch: int) -> bool:
    ctx = engine.context
    active = np.array(ctx.active, dtype=np.int64)
    return active.size == batch and bool((ctx.kv_len[active] == ctx.seq_len[active] - 1).all())


def _timed_steps(engine: DynamicInferenceEngine, clock: Stopwatch, steps: int, batch: int):
    """Run `steps` decode steps; per step its wall time and its phases' times."""
    walls, phases = [], []
    for _ in range(steps):
        clock.take()
        start = time.perf_counter()
        finished = engine.step()
        walls.append(time.perf_counter() - start)
        phases.append(clock.take())
        if finished or len(engine.context.active) != batch:
            raise RuntimeError(f"a request finished or paused mid-measurement ({len(engine.context.active)} active)")
    return walls, phases


def _arm_params(arm: str, vocab: int, max_tokens: int, rng: random.Random) -> SamplingParams:
    """One request of the `--processors` arm `arm` (see `PROC_ARMS`)."""
    if arm == "off":
        return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    bias = {rng.randrange(3, vocab): rng.uniform(-5, 5) for _ in range(PROC_BIAS)}
    bad = [[rng.randrange(3, vocab) for _ in range(k)] for k in (1, 1, 2, 3)]
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, repetition_penalty=1.1,
                          presence_penalty=0.2, frequency_penalty=0.1, logit_bias=bias, bad_words_token_ids=bad,
                          structured_outputs={"json": PROC_SCHEMA} if arm == "all" else None)


def _decoding_engine(real, batch: int, args: argparse.Namespace, max_tokens: int, arm: str) -> DynamicInferenceEngine:
    """A stand-in engine with `batch` requests of arm `arm`, all prefilled and decoding."""
    per_request = -(-(args.prompt_len + max_tokens) // BLOCK_SIZE)
    config = InferenceConfig(block_size=BLOCK_SIZE, num_blocks=batch * per_request + 8, max_requests=MAX_REQUESTS,
                             max_batch_tokens=STEP_TOKENS, max_sequence_length=1024, dtype=real.spec.dtype,
                             tokenizer=str(smollm2_dir()))
    engine = DynamicInferenceEngine(InstantLogits(real, MAX_REQUESTS), config)
    rng = random.Random(batch)
    vocab = real.spec.vocab_size
    for _ in range(batch):
        engine.add_request([rng.randrange(3, vocab) for _ in range(args.prompt_len)],
                           _arm_params(arm, vocab, max_tokens, rng))
    while not _decode_ready(engine, batch):
        engine.step()
    return engine


@dataclass(slots=True)
class ProcessorResult:
    batch: int
    step_s: dict[str, float]  # median stand-in step per arm (PROC_ARMS)
    phases: dict[str, dict[str, float]]


def bench_processors(real, batch: int, args: argparse.Namespace) -> ProcessorResult:
    turns = max(args.steps // PROC_CHUNK, 2)
    prefill_steps = -(-batch * args.prompt_len // STEP_TOKENS) + 1
    max_tokens = prefill_steps + args.warmup + turns * PROC_CHUNK + 4
    engines = {arm: _decoding_engine(real, batch, args, max_tokens, arm) for arm in PROC_ARMS}
    clock = Stopwatch()
    walls: dict[str, list[float]] = {arm: [] for arm in PROC_ARMS}
    phases: dict[str, list[dict[str, float]]] = {arm: [] for arm in PROC_ARMS}
    for engine in engines.values():
        _instrument(engine, clock)
    try:
        for engine in engines.values():
            _timed_steps(engine, clock, args.warmup, batch)
        for turn in range(turns):
            shift = turn % len(PROC_ARMS)  # NOTE: each arm takes each place in the turn order alike
            for arm in PROC_ARMS[shift:] + PROC_ARMS[:shift]:
                w, ph = _timed_steps(engines[arm], clock, PROC_CHUNK, batch)
                walls[arm] += w
                phases[arm] += ph
    finally:
        _restore()
    return ProcessorResult(batch, {arm: median(walls[arm]) for arm in walls},
                           {arm: {p: median([ph.get(p, 0.0) for ph in phases[arm]]) for p in PHASES}
                            for arm in phases})


def print_processor_results(results: list[ProcessorResult]) -> None:
    print("\n-- off: plain; proc: penalties + logit_bias + bad words on every request; all: those and a JSON "
          "grammar on every request; stand-in model, median ms per decode step")
    header = (f"{'active':>6} {'step off':>9} {'proc':>8} {'all':>8} {'proc/off':>8} {'all/off':>8} "
              f"{'+us/req':>8} " + " ".join(f"{f'{p} {a}':>11}" for p in ("batch", "sample", "commit")
                                            for a in PROC_ARMS))
    print(header)
    print("-" * len(header))
    for r in results:
        step = r.step_s
        cells = " ".join(f"{_ms(r.phases[a][phase]):>11}" for phase in ("sampling_batch", "sample", "commit")
                         for a in PROC_ARMS)
        print(f"{r.batch:>6} {_ms(step['off']):>9} {_ms(step['proc']):>8} {_ms(step['all']):>8} "
              f"{step['proc'] / step['off']:>8.2f} {step['all'] / step['off']:>8.2f} "
              f"{(step['all'] - step['off']) * 1e6 / r.batch:>8.1f} {cells}")
    print("batch = building the SamplingBatch (the processors' sparse indices, the grammar masks filled); "
          "sample = the sampler (processors and masks applied as batched ops); commit = appending tokens "
          "(penalty counts, matchers advanced); +us/req = (all - off) / active")
    print_result("step_overhead_processors",
                 {f"{arm}/off[{r.batch}]": r.step_s[arm] / r.step_s["off"] for r in results for arm in ("proc", "all")}
                 | {f"step_ms_{arm}[{r.batch}]": r.step_s[arm] * 1e3 for r in results for arm in PROC_ARMS})


def bench_batch(real, batch: int, args: argparse.Namespace, profile: bool) -> BatchResult:
    stub = InstantLogits(real, MAX_REQUESTS)
    # NOTE: requests admitted first decode while later ones prefill: leave room for those tokens
    prefill_steps = -(-batch * args.prompt_len // STEP_TOKENS) + 1
    max_tokens = prefill_steps + args.warmup + args.steps + 1 + args.real_steps + 4
    per_request = -(-(args.prompt_len + max_tokens) // BLOCK_SIZE)
    config = InferenceConfig(
        block_size=BLOCK_SIZE,
        num_blocks=batch * per_request + 8,
        max_requests=MAX_REQUESTS,
        max_batch_tokens=STEP_TOKENS,
        max_sequence_length=1024,
        dtype=real.spec.dtype,
    )
    engine = DynamicInferenceEngine(stub, config)
    rng = random.Random(batch)
    vocab = real.spec.vocab_size
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(3, vocab) for _ in range(args.prompt_len)], params)
    while not _decode_ready(engine, batch):  # prefill on the stand-in
        engine.step()
    clock = Stopwatch()
    _instrument(engine, clock)
    try:
        load = load_average()
        _timed_steps(engine, clock, args.warmup, batch)
        profiler = cProfile.Profile() if profile else None
        if profiler is not None:
            profiler.enable()
        stub_walls, stub_phases = _timed_steps(engine, clock, args.steps, batch)
        if profiler is not None:
            profiler.disable()
            _print_profile(profiler, batch, args.steps)
        # NOTE: the wrapped `runner.forward` calls whatever model the runner holds
        engine.core.runner.model = real
        _timed_steps(engine, clock, 1, batch)  # warm-up of the real forward
        ctx = engine.context
        context = int(np.median(ctx.kv_len[np.array(ctx.active)])) + 1
        real_walls, real_phases = _timed_steps(engine, clock, args.real_steps, batch)
    finally:
        _restore()
    stub_phases_med = {p: window_median([ph.get(p, 0.0) for ph in stub_phases]) for p in PHASES}
    stub_phases_med["other"] = window_median([w - sum(ph.values()) for w, ph in zip(stub_walls, stub_phases)])
    return BatchResult(
        batch=batch,
        context=context,
        stub_step_s=window_median(stub_walls),
        stub_phases=stub_phases_med,
        rest_s=window_median([w - ph.get("sample", 0.0) - ph.get("sampling_batch", 0.0)
                              for w, ph in zip(stub_walls, stub_phases)]),
        real_step_s=median(real_walls),
        forward_s=median([ph["forward"] for ph in real_phases]),
        load=load,
    )


def window_median(values: list[float], window: int = BLOCK_SIZE) -> float:
    """The median over every run of `window` consecutive steps of its mean step time.

    A request's block fills once in `window` steps, so registration is a cost of some steps only
    (here, prompts of one length admitted in groups, of about half of them): a plain median of
    per-step times falls on one side of it; the mean over a whole period counts it at its rate, and
    the median over the periods keeps a stray slow step (a page fault, a preemption) out.
    """
    if len(values) < window:
        return median(values)
    sums = np.convolve(np.asarray(values), np.ones(window), mode="valid")
    return float(np.median(sums)) / window


def _print_profile(profiler: cProfile.Profile, batch: int, steps: int) -> None:
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(18)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    print(f"-- cProfile of {steps} stand-in steps at {batch} requests, top functions by own time:")
    for line in lines[start:]:
        print("   " + line.replace(os.getcwd() + "/", "")[:150])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f}"


def _us_per(seconds: float, requests: int) -> str:
    return f"{seconds * 1e6 / requests:8.1f}"


def print_results(results: list[BatchResult]) -> None:
    print("\n-- stand-in model (forward ~0): engine's own time per decode step, ms (median over every 16 consecutive "
          "steps of their mean: a block fills once in 16); us/req = step / active")
    shown = [p for p in (*PHASES, "other") if p != "forward"]
    header = f"{'active':>6} {'step':>8} {'us/req':>8} " + " ".join(f"{p:>15}" for p in shown)
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.batch:>6} {_ms(r.stub_step_s)} {_us_per(r.stub_step_s, r.batch)} "
            + " ".join(f"{_ms(r.stub_phases[p]):>15}" for p in shown)
        )
    print(
        "\n-- real SmolLM2-135M forward at the same batch, median ms (us/req: per active request); "
        "overhead = stand-in step"
    )
    header = (
        f"{'active':>6} {'context':>7} {'forward':>8} {'fwd us/req':>10} {'real step':>9} {'overhead':>8} "
        f"{'ovh us/req':>10} {'sampling':>8} {'rest':>8} {'overhead/fwd':>12} {'in-place ovh':>12} {'load':>5}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        sampling = r.stub_phases["sample"] + r.stub_phases["sampling_batch"]
        print(
            f"{r.batch:>6} {r.context:>7} {_ms(r.forward_s)} {_us_per(r.forward_s, r.batch):>10} "
            f"{_ms(r.real_step_s):>9} {_ms(r.overhead_s)} {_us_per(r.overhead_s, r.batch):>10} "
            f"{_ms(sampling)} {_ms(r.rest_s)} {r.overhead_s / r.forward_s:>11.1%} "
            f"{_ms(r.in_place_overhead_s):>12} {r.load:>5.2f}"
        )
    print(
        "sampling = sampler + building its SamplingBatch; rest = each step's time outside sampling (its "
        "bookkeeping); stand-in figures are medians over every 16 consecutive steps of their mean; in-place ovh = real "
        "step - its forward (same overhead, measured beside the real model)"
    )
    print(
        "engine overhead / SmolLM2 forward: "
        + ", ".join(f"{r.overhead_s / r.forward_s:.1%} at {r.batch}" for r in results)
        + "; per request: "
        + ", ".join(f"{r.overhead_s * 1e6 / r.batch:.1f} us at {r.batch}" for r in results)
    )
    figures = {}
    for r in results:
        figures[f"step_ms[{r.batch}]"] = r.stub_step_s * 1e3
        figures[f"us_per_request[{r.batch}]"] = r.stub_step_s * 1e6 / r.batch
        figures[f"overhead/forward[{r.batch}]"] = r.overhead_s / r.forward_s
        figures[f"bookkeeping_ms[{r.batch}]"] = r.rest_s * 1e3
    print_result("step_overhead", figures)


def _batches(text: str) -> list[int]:
    sizes = [int(s) for s in text.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or max(sizes) > MAX_REQUESTS:
        raise argparse.ArgumentTypeError(f"batch sizes must be in 1..{MAX_REQUESTS}, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=_batches, default=None, help="active requests (default 16,64,256)")
    parser.add_argument("--steps", type=int, default=None, help="timed stand-in steps per batch (default 40)")
    parser.add_argument("--real-steps", type=int, default=None, help="timed real-model steps per batch (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed stand-in steps first")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16,64 requests, few steps")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--profile", action="store_true", help="cProfile the stand-in steps at the largest batch")
    parser.add_argument("--processors", action="store_true",
                        help="time the logit processors on vs off (stand-in model only) instead")
    args = parser.parse_args(argv)
    args.batches = args.batches or ([16, 64] if args.quick else [16, 64, 256])
    args.steps = args.steps or (10 if args.quick else 40)
    args.real_steps = args.real_steps or (2 if args.quick else 5)
    if min(args.steps, args.real_steps, args.prompt_len, args.threads) < 1 or args.warmup < 0:
        parser.error("--steps, --real-steps, --prompt-len and --threads must be >= 1, --warmup >= 0")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    real = load_from_hf_dir(smollm2_dir(), dtype=DTYPES[args.dtype])
    print(
        f"step overhead, SmolLM2-135M-Instruct ({args.dtype}, vocab {real.spec.vocab_size}), prompts of "
        f"{args.prompt_len} tokens, temperature 1.0, {args.steps} stand-in / {args.real_steps} real steps timed; "
        f"{machine_line()}"
    )
    if args.processors:
        proc_results = []
        for batch in args.batches:
            proc_results.append(bench_processors(real, batch, args))
            print(f"  {batch} requests done, load {load_average():.2f}", flush=True)
        print_processor_results(proc_results)
        print(f"done; {machine_line()}")
        return 0
    results = []
    for batch in args.batches:
        results.append(bench_batch(real, batch, args, profile=args.profile and batch == max(args.batches)))
        print(f"  {batch} requests done, load {load_average():.2f}", flush=True)
    print_results(results)
    print(f"done; {machine_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
