"""Service layers at two commits: generate latency and tokens/s through `rollout serve` and through
`rollout route` over it, each commit's own code, measured in the same run, interleaved.

Written for the reshape of the layers above the engine core (base c1fb8ae: a flat rollout/;
head: client/, wire/, service/, server/, router/, rl/, calls posted to the engine loop), but any
two commits whose `rollout` exports `AsyncRolloutClient`, `ServerProcess` and `RouterProcess` work.
NOTE: `bench/compare_commits.py` runs each commit's own `bench/NAME.py`; the base has no bench of
this, so this file carries its driver and runs it against either commit's packages.

Each commit's tracked tree is extracted once into a cache directory (reused by later runs). Every
repeat runs this file's `driver` in a fresh subprocess per commit, with cwd and PYTHONPATH = that
tree, so the commit's client, server and router are measured with the same venv, model (a 1-layer,
hidden-32, vocab-384 random Llama: the engine is nearly free, so the service layers dominate),
seed and engine flags. The driver starts `rollout serve` (1 torch thread) on a loopback port the
OS picks and `rollout route` with that one replica, warms both paths, then measures each with one
`AsyncRolloutClient`: 1 request in flight (sequential calls) and 64 in flight (64 workers calling
back to back); 16-token random prompts, 16 greedy tokens with EOS ignored, so the work is the same.

Repeats alternate the order (base, head / head, base / ...), so load drifts hit both. Reported per
figure: medians and [min-max] over repeats, and "head better by": base/head for latency,
head/base for tokens/s (> 1: head is better), plus the [min-max] of the per-repeat pair ratios.

    python bench/compare_service.py --base c1fb8ae --head HEAD --repeats 5
    python bench/compare_service.py --quick   # smoke: 2 repeats, fewer requests
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT_PREFIX = "RESULT "
PROMPT_LEN, MAX_TOKENS, WIDE, VOCAB = 16, 16, 64, 384
SERVER_ARGS = ("--threads", "1", "--block-size", "16", "--num-blocks", "2048", "--max-requests", "128",
               "--max-batch-tokens", "2048", "--max-seq-len", "256", "--lease-s", "600")
PATHS = ("server", "router")


# ---- the driver: runs inside one commit's tree, imports only what both commits export ----


def save_model(directory: Path, seed: int) -> None:
    """The service tests' tiny Llama (tests/rollout/service_util.py), built once and shared by
    both commits, so they load the same bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=directory.name + "."))
    LlamaForCausalLM(cfg).eval().save_pretrained(staging)
    staging.rename(directory)  # NOTE: atomic, so a killed run never leaves half a model to reuse


class Prompts:
    """Fresh seeded prompts: no two requests share a prefix (the router path reaches the same
    server, whose prefix cache would otherwise make its requests cheaper)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def take(self) -> list[int]:
        return [self.rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]


async def timed_call(client, prompt: list[int], sampling) -> tuple[float, list[int]]:
    start = time.perf_counter()
    batch = await client.generate([prompt], 1, sampling)
    return time.perf_counter() - start, batch.rollouts[0].completion_ids


async def closed_loop(client, prompts: Prompts, sampling, inflight: int, per_worker: int):
    """`inflight` workers, each calling `per_worker` times back to back: (latencies, tokens, wall)."""
    latencies, tokens = [], [0]

    async def worker() -> None:
        for _ in range(per_worker):
            seconds, ids = await timed_call(client, prompts.take(), sampling)
            latencies.append(seconds)
            tokens[0] += len(ids)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    return latencies, tokens[0], time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(addresses: dict[str, str], args: argparse.Namespace) -> tuple[dict[str, float], str]:
    from inference import SamplingParams
    from rollout import AsyncRolloutClient

    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts, figures, digest = Prompts(args.seed), {}, hashlib.sha256()
    for path, address in addresses.items():
        async with AsyncRolloutClient(address, timeout=600, lease_s=600) as client:
            if path == "router":  # NOTE: requests sent before the router sees its replica up would wait
                deadline = time.monotonic() + 60
                while (await client.stats()).get("replicas_up", 0) < 1:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the router did not see its replica up within 60 s")
                    await asyncio.sleep(0.05)
            await closed_loop(client, prompts, sampling, WIDE, 1)  # warm-up: first steps, connections
            await closed_loop(client, prompts, sampling, 1, 5)
            single = []
            for _ in range(args.single):
                seconds, ids = await timed_call(client, prompts.take(), sampling)
                single.append(seconds)
                digest.update(repr((path, ids)).encode())  # greedy: both commits must agree
            wide, tokens, wall = await closed_loop(client, prompts, sampling, WIDE, args.per_worker)
            if tokens != WIDE * args.per_worker * MAX_TOKENS:
                raise RuntimeError(f"{path}: {tokens} tokens generated, {WIDE * args.per_worker * MAX_TOKENS} asked")
        for inflight, values in ((1, single), (WIDE, wide)):
            figures[f"p50_ms[{path},{inflight}]"] = 1e3 * percentile(values, 0.5)
            figures[f"p99_ms[{path},{inflight}]"] = 1e3 * percentile(values, 0.99)
        figures[f"tok_s[{path},{WIDE}]"] = tokens / wall
    return figures, digest.hexdigest()[:16]


def driver(args: argparse.Namespace) -> int:
    import rollout
    from rollout import RouterProcess, ServerProcess

    tree = Path.cwd().resolve()
    if not Path(rollout.__file__).resolve().is_relative_to(tree):
        raise RuntimeError(f"`import rollout` resolves to {rollout.__file__}, not inside {tree}")
    if not (args.model_dir / "config.json").is_file():
        save_model(args.model_dir, args.seed)
    with ServerProcess(args.model_dir, *SERVER_ARGS) as server, \
            RouterProcess("--replicas", server.address, "--lease-s", "600") as router:
        addresses = {"server": server.address, "router": router.address}
        order = args.order.split(",")  # NOTE: the first path measured runs in the younger processes
        figures, digest = asyncio.run(measure({path: addresses[path] for path in order}, args))
    print(RESULT_PREFIX + json.dumps({"figures": figures, "digest": digest, "load": os.getloadavg()[0]}), flush=True)
    return 0


# ---- the orchestrator: no torch here, only git and subprocesses ----


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def tree_for(repo: Path, commit: str, cache: Path) -> Path:
    """The commit's tracked files under `cache/<sha>`, extracted once and reused. NOTE: `git archive`
    rather than `git worktree add`: nothing is registered in the (shared) repository to clean up."""
    tree = cache / commit
    if not tree.is_dir():
        staging = Path(tempfile.mkdtemp(dir=cache, prefix=f"{commit}."))
        archive = subprocess.Popen(["git", "-C", str(repo), "archive", "--format=tar", commit], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(staging)], stdin=archive.stdout, check=True)
        archive.stdout.close()
        if archive.wait() != 0:
            raise RuntimeError(f"git archive {commit} failed")
        staging.rename(tree)
    return tree


def run_driver(tree: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: spinning OpenMP threads starve the other processes
    command = [sys.executable, str(Path(__file__).resolve()), "driver", "--model-dir", str(args.model_dir),
               "--single", str(args.single), "--per-worker", str(args.per_worker), "--seed", str(args.seed),
               "--order", args.order]
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"the driver in {tree} exited {proc.returncode}:\n{tail}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def better_by(name: str, base: float, head: float) -> float:
    """> 1: head is better (latency: base/head; tokens/s: head/base)."""
    return head / base if name.startswith("tok_s") else base / head


def spread(values: list[float]) -> str:
    def show(v: float) -> str:
        return f"{v:,.0f}" if v >= 1000 else f"{v:.2f}"

    return f"{show(statistics.median(values))} [{show(min(values))}-{show(max(values))}]"


def report(runs: dict[str, list[dict]], labels: dict[str, str]) -> None:
    names = list(runs["base"][0]["figures"])
    print(f"\nbase = {labels['base']}, head = {labels['head']}; {len(runs['base'])} repeats each; "
          f"{WIDE} in flight = {WIDE} workers calling back to back; {PROMPT_LEN}-token prompts, {MAX_TOKENS} tokens")
    header = (f"{'figure':<20} {'base median [min-max]':>27} {'head median [min-max]':>27} "
              f"{'head better by':>14} {'pair ratios [min-max]':>22}")
    print(header + "\n" + "-" * len(header))
    for name in names:
        base = [r["figures"][name] for r in runs["base"]]
        head = [r["figures"][name] for r in runs["head"]]
        pairs = [better_by(name, b, h) for b, h in zip(base, head)]
        ratio = better_by(name, statistics.median(base), statistics.median(head))
        print(f"{name:<20} {spread(base):>27} {spread(head):>27} {ratio:>13.3f}x "
              f"{f'[{min(pairs):.3f}-{max(pairs):.3f}]':>22}")
    print("head better by: base/head for latency (ms), head/base for tok/s; > 1 means head is better.")
    print("pair ratios: the same ratio within each repeat (its base and head runs were adjacent).")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=["compare", "driver"], default="compare",
                        help="driver: one measurement in the current tree (what compare runs per repeat)")
    parser.add_argument("--base", default="c1fb8ae", help="the base commit (default c1fb8ae, before the reshape)")
    parser.add_argument("--head", default="HEAD", help="the commit under test (default HEAD)")
    parser.add_argument("--repeats", type=int, help="driver runs per commit, interleaved (default 5; --quick 2)")
    parser.add_argument("--single", type=int, help="sequential requests at 1 in flight (default 200; --quick 20)")
    parser.add_argument("--per-worker", type=int, help=f"calls per worker at {WIDE} in flight (default 40; --quick 2)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 repeats, fewer requests")
    parser.add_argument("--seed", type=int, default=0, help="model weights and prompts")
    parser.add_argument("--order", default="server,router", choices=["server,router", "router,server"],
                        help="which path each driver run measures first")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "compare_service",
                        help="extracted trees and the model, reused across runs")
    parser.add_argument("--model-dir", type=Path, help="the model directory (default CACHE/model-seedSEED)")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent, help="a path in the git repo")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per driver run")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.single = args.single or (20 if args.quick else 200)
    args.per_worker = args.per_worker or (2 if args.quick else 40)
    args.cache = args.cache.resolve()
    args.model_dir = (args.model_dir or args.cache / f"model-seed{args.seed}").resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.mode == "driver":
        return driver(args)
    args.cache.mkdir(parents=True, exist_ok=True)
    repo = Path(git(args.repo, "rev-parse", "--show-toplevel"))
    commits = {side: git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")
               for side, rev in (("base", args.base), ("head", args.head))}
    labels = {side: f"{rev} ({commits[side][:10]})" for side, rev in (("base", args.base), ("head", args.head))}
    trees = {side: tree_for(repo, commit, args.cache) for side, commit in commits.items()}
    runs: dict[str, list[dict]] = {"base": [], "head": []}
    start = time.perf_counter()
    try:
        for repeat in range(args.repeats):
            for side in ("base", "head") if repeat % 2 == 0 else ("head", "base"):
                began = time.perf_counter()
                result = run_driver(trees[side], args)
                runs[side].append(result)
                shown = ", ".join(f"{k} {v:.4g}" for k, v in result["figures"].items())
                print(f"[{repeat + 1}/{args.repeats}] {side}: {time.perf_counter() - began:.0f} s, "
                      f"load {result['load']:.2f}; {shown}", flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 1
    report(runs, labels)
    digests = {r["digest"] for rs in runs.values() for r in rs}
    agree = "agree" if len(digests) == 1 else f"DIFFER ({sorted(digests)}): the commits did not do the same work"
    print(f"total {time.perf_counter() - start:.0f} s; greedy outputs of every run {agree}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
