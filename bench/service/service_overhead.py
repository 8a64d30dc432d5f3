"""Service overhead: the same engine through `rollout serve` + `RolloutClient` (and through
`rollout route` over 1 and 2 replicas) vs in process.

Throughput: the tiny-model GRPO workload of `bench/throughput/rollout_throughput.py` (its `Workload`: seeded
prompts of 32-256 tokens, n samples each with its own output length of 16-256 tokens, EOS
ignored, temperature 1.0), one n=1 request per sample with its own `max_tokens`:

* in process (the peer): `DynamicInferenceEngine.generate`, the caller's thread stepping, as
  `rollout_throughput.py` runs it;
* remote: a `rollout serve` child process on loopback with the same model directory, engine
  configuration and torch threads, fed by one `RolloutClient` (every request in flight at once).

* through a router (`--router`, on by default): `rollout route` child processes, one over the
  remote side's server ("router x1", one more hop), one over it and a second `rollout serve`
  with the same model and threads ("router x2"), each fed by one `RolloutClient` the same way.

tokens/s = useful tokens / wall time; the ratio remote / in-process is the figure (target >= 0.9).
On a machine with fewer cores than the replicas' threads, two replicas share the cores: "router
x2" measures the router's overhead and balance there, not a speed-up.

Latency: requests of `--latency-prompt` tokens and `--latency-tokens` greedy tokens, at 1 and 64
in flight (rounds of that many submitted together), through `RolloutBackend.stream` on both
sides (`RolloutEngine` in process, `RolloutClient` remote); each request's latency runs from the
call to its sample's arrival. Added latency = remote - in-process, at p50 and p99.

Runs alternate between the sides (`--repeats`), so load drifts on a shared machine hit both;
medians are reported with the load average. `--quick`: 8 prompts x n=4, outputs 8-32, fewer
latency rounds. The throughput figures end in a `RESULT {json}` line (`bench/throughput/compare_commits.py`).
Exits 1 if a side returned other token counts than asked.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads OpenMP; see common.py

import argparse  # noqa: E402
import contextlib  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.common import TINY, hf_model, load_average, machine_line, median, print_result  # noqa: E402
from bench.throughput.rollout_throughput import BLOCK_SIZE  # noqa: E402
from bench.throughput.rollout_workload import FIRST_TOKEN, Budget, Workload, make_workload  # noqa: E402
from inference import DynamicInferenceEngine, InferenceConfig, SamplingParams  # noqa: E402
from rollout import RolloutClient, RolloutEngine, RouterProcess, ServerProcess  # noqa: E402

TARGET = 0.9  # remote / in-process tokens/s, from the issue


def engine_config(budget: Budget) -> InferenceConfig:
    return InferenceConfig(block_size=BLOCK_SIZE, num_blocks=budget.kv_tokens // BLOCK_SIZE,
                           max_requests=budget.max_requests, max_batch_tokens=budget.step_tokens)


def server_args(budget: Budget, threads: int) -> list[str]:
    return ["--threads", str(threads), "--block-size", str(BLOCK_SIZE), "--num-blocks",
            str(budget.kv_tokens // BLOCK_SIZE), "--max-requests", str(budget.max_requests),
            "--max-batch-tokens", str(budget.step_tokens), "--max-seq-len", "4096"]


def samples(work: Workload) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [p for p, ls in zip(work.prompts, work.lengths) for _ in ls]
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for ls in work.lengths for m in ls]
    return prompts, params


def warm(generate) -> None:
    generate([[FIRST_TOKEN + i] * 40 for i in range(4)], SamplingParams(max_tokens=4, ignore_eos=True))


def run_local(engine: DynamicInferenceEngine, work: Workload) -> tuple[float, bool]:
    prompts, params = samples(work)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    return wall, [len(o.generated_token_ids) for o in outputs] == [p.max_tokens for p in params]


def run_remote(client: RolloutClient, work: Workload) -> tuple[float, bool]:
    prompts, params = samples(work)
    start = time.perf_counter()
    streams = [client.stream([p], 1, sp) for p, sp in zip(prompts, params)]  # all in flight at once
    results = [s.result()[0] for s in streams]
    wall = time.perf_counter() - start
    return wall, [len(r.completion_ids) for r in results] == [p.max_tokens for p in params]


def wait_replicas(client: RolloutClient, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while client.stats().get("replicas_up", 0) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router did not see {count} replicas up within {timeout} s")
        time.sleep(0.1)


def latencies(backend, concurrency: int, rounds: int, prompt_len: int, tokens: int) -> list[float]:
    """Seconds from the call to each request's sample, `concurrency` requests per round."""
    sampling = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = []
    for r in range(rounds):
        prompts = [[FIRST_TOKEN + (r * concurrency + i) % 1000] * prompt_len for i in range(concurrency)]
        start = time.perf_counter()
        for _ in backend.stream(prompts, 1, sampling):
            out.append(time.perf_counter() - start)
    return out


def interleaved_throughput(sides, repeats: int, work: Workload) -> tuple[dict[str, float], bool]:
    """Each side's tok/s, the median of `repeats` runs taken in turn (side after side, so all
    share the machine's load), and whether every run produced the right token counts."""
    walls: dict[str, list[float]] = {side: [] for side in sides}
    ok = True
    for rep in range(repeats):
        for side, run in sides.items():
            load = load_average()
            wall, good = run()
            ok &= good
            walls[side].append(wall)
            print(f"  run {rep + 1} {side:<10} {wall:7.2f} s  {work.useful_tokens / wall:8.1f} tok/s  "
                  f"load {load:.2f}{'' if good else '  TOKEN COUNTS WRONG'}", flush=True)
    return {side: work.useful_tokens / median(w) for side, w in walls.items()}, ok


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def overhead_parser(description: str) -> argparse.ArgumentParser:
    """The options this bench and `http_overhead` share."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--prompts", type=int, help="prompts (default 64; --quick 8)")
    parser.add_argument("--n", type=int, help="samples per prompt (default 8; --quick 4)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 prompts x n=4, outputs 8-32")
    parser.add_argument("--repeats", type=int, default=2, help="throughput runs per side, interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    parser.add_argument("--latency-rounds", type=int, help="rounds per concurrency (default 40 at 1, 6 at 64)")
    parser.add_argument("--latency-prompt", type=int, default=32)
    parser.add_argument("--latency-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run_shape(args: argparse.Namespace) -> tuple[int, int, tuple[int, int], tuple[int, int], float, dict[int, int]]:
    """(prompts, n, prompt lengths, output lengths, KV GiB, latency rounds per concurrency) of a run."""
    prompts = args.prompts or (8 if args.quick else 64)
    n = args.n or (4 if args.quick else 8)
    prompt_len, output_len = ((32, 64), (8, 32)) if args.quick else ((32, 256), (16, 256))
    kv_gib = 0.25 if args.quick else 2.0
    rounds = {1: args.latency_rounds or (10 if args.quick else 40), 64: args.latency_rounds or (2 if args.quick else 6)}
    return prompts, n, prompt_len, output_len, kv_gib, rounds


def main(argv: list[str] | None = None) -> int:
    parser = overhead_parser(__doc__.splitlines()[0])
    parser.add_argument("--no-router", dest="router", action="store_false",
                        help="skip the router sides (rollout route over 1 and 2 replicas)")
    args = parser.parse_args(argv)
    prompts, n, prompt_len, output_len, kv_gib, rounds = run_shape(args)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print(f"service overhead: rollout serve + RolloutClient vs the in-process engine; {machine_line()}")
    model = hf_model(TINY, torch.float32)
    work = make_workload(prompts, n, prompt_len, output_len, model.config.vocab_size, args.seed)
    budget = Budget.for_workload(model, work, kv_gib, 2048, 256)
    print(f"workload: {work.describe()}; KV {budget.kv_tokens:,} tokens, {budget.step_tokens} tokens/step, "
          f"{budget.max_requests} requests, {args.threads} torch threads each side")
    ok = True
    with tempfile.TemporaryDirectory(prefix="service-bench-") as tmp:
        model_dir = Path(tmp) / "tiny"
        model.save_pretrained(model_dir)
        del model
        local = RolloutEngine(model_dir, engine_config(budget))
        start = time.perf_counter()
        with ServerProcess(model_dir, *server_args(budget, args.threads)) as server, \
                RolloutClient(server.address, timeout=3600, lease_s=600) as client, \
                contextlib.ExitStack() as routers:
            print(f"server up in {time.perf_counter() - start:.1f} s at {server.address} (pid {server.pid})")
            sides = {"in-process": lambda: run_local(local.engine, work), "remote": lambda: run_remote(client, work)}
            warm(lambda p, sp: local.engine.generate(p, sp))
            warm(lambda p, sp: client.generate(p, 1, sp))
            if args.router:
                second = routers.enter_context(ServerProcess(model_dir, *server_args(budget, args.threads)))
                for label, replicas in (("router x1", [server]), ("router x2", [server, second])):
                    proc = routers.enter_context(RouterProcess("--replicas", ",".join(r.address for r in replicas)))
                    rc = routers.enter_context(RolloutClient(proc.address, timeout=3600, lease_s=600))
                    wait_replicas(rc, len(replicas))
                    warm(lambda p, sp, rc=rc: rc.generate(p, 1, sp))
                    sides[label] = lambda rc=rc: run_remote(rc, work)
                print(f"routers up: {', '.join(s for s in sides if s.startswith('router'))}")
            tps, good = interleaved_throughput(sides, args.repeats, work)
            ok &= good
            ratio = tps["remote"] / tps["in-process"]
            print(f"-- throughput, median of {args.repeats}: in-process {tps['in-process']:.1f} tok/s, remote "
                  f"{tps['remote']:.1f} tok/s: remote / in-process {ratio:.3f}x "
                  f"(target >= {TARGET}: {'met' if ratio >= TARGET else 'NOT met'})")
            for side in (s for s in sides if s.startswith("router")):
                print(f"-- throughput through {side}: {tps[side]:.1f} tok/s, {tps[side] / tps['in-process']:.3f}x "
                      f"in-process, {tps[side] / tps['remote']:.3f}x remote")
            print(f"-- latency, {args.latency_prompt}-token prompts, {args.latency_tokens} greedy tokens "
                  "(ms from the call to the sample)")
            print(f"{'in flight':>9} {'requests':>8} {'local p50':>10} {'local p99':>10} {'remote p50':>11} "
                  f"{'remote p99':>11} {'added p50':>10} {'added p99':>10} {'p50 ratio':>9}")
            for concurrency in (1, 64):
                local_ms, remote_ms = [], []
                for _ in range(2):  # NOTE: alternate halves, so load drifts hit both sides
                    half = max(1, rounds[concurrency] // 2)
                    local_ms += latencies(local, concurrency, half, args.latency_prompt, args.latency_tokens)
                    remote_ms += latencies(client, concurrency, half, args.latency_prompt, args.latency_tokens)
                lp50, lp99, rp50, rp99 = (1e3 * pct(local_ms, 0.5), 1e3 * pct(local_ms, 0.99),
                                          1e3 * pct(remote_ms, 0.5), 1e3 * pct(remote_ms, 0.99))
                print(f"{concurrency:>9} {len(local_ms):>8} {lp50:>10.2f} {lp99:>10.2f} {rp50:>11.2f} {rp99:>11.2f} "
                      f"{rp50 - lp50:>+10.2f} {rp99 - lp99:>+10.2f} {rp50 / lp50:>8.2f}x")
            figures = {f"tok_s[{side}]": value for side, value in tps.items()}
            figures.update({f"ratio[{side} / in-process]": value / tps["in-process"]
                            for side, value in tps.items() if side != "in-process"})
            print_result("service_overhead", figures, repeats=args.repeats, threads=args.threads,
                         workload=work.describe())
            stats = client.stats()
            print(f"server: {stats['requests_run']} requests run, {stats['tokens_sent']:,} tokens sent, "
                  f"{stats['engine/steps']:,} engine steps, errors {stats.get('errors/INTERNAL', 0)} internal")
    print(f"done; {machine_line()}")
    if not ok:
        print("ERROR: a side returned other token counts than asked for", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
