"""Service layers at two commits: generate latency and tokens/s through `rollout serve` and through
`rollout route` over it, each commit's own code, both up at once and measured in lockstep.

Written for the reshape of the layers above the engine core (base c1fb8ae: a flat rollout/;
head: client/, wire/, service/, server/, router/, rl/, calls posted to the engine loop), but any
two commits whose `rollout` exports `AsyncRolloutClient`, `ServerProcess` and `RouterProcess` work.
NOTE: `bench/throughput/compare_commits.py` runs each commit's own `bench/NAME.py`; the base has no bench of
this, so this file carries its driver and runs it against either commit's packages.

Why lockstep: this machine's speed drifts in windows of about half a second (an engine step here
takes 0.9 ms in one window and 1.4 ms in the next, on either core, with nothing else running), so
two commits measured one after the other in separate processes differ by +-10% whatever their code
does. Here each commit's tracked tree is extracted once into a cache directory, and one `driver`
per commit runs at the same time, with cwd and PYTHONPATH = its tree (same venv, model, seed and
engine flags). Each driver starts `rollout serve` (1 torch thread) on a loopback port the OS picks
and `rollout route` with that one replica, warms both paths, then waits for commands on stdin.
The orchestrator hands out short blocks, one driver at a time (the idle one only polls), and
alternates which commit goes first in each round, so both see the same drift:

* 1 in flight: `--single` sequential calls per block;
* 64 in flight: 64 workers calling `--per-worker` times back to back.

16-token random prompts, 16 greedy tokens with EOS ignored, the same prompt sequence in both
drivers, so the work is the same (the greedy outputs are checked to agree). The model is a 1-layer,
hidden-32, vocab-384 random Llama: the engine is nearly free, so the service layers dominate.
Reported per figure: each commit's median over rounds of its per-block figure (p50 / p99 of the
block's calls, tokens/s over its wall time), "head better by" of those medians (base/head for
latency, head/base for tokens/s; > 1: head is better), the [p10-p90] of the per-round ratios (each
round's blocks ran back to back), and the ratio with every call of every round pooled. NOTE: the
idle commit's stack still polls (its router asks its server for KV events every 50 ms), so each
commit is measured beside the other's idle stack.

    python bench/service/compare_service.py --base c1fb8ae --head HEAD
    python bench/service/compare_service.py --quick   # smoke: 3 rounds, short blocks
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

RESULT_PREFIX, READY_LINE = "RESULT ", "READY"
PROMPT_LEN, MAX_TOKENS, WIDE, VOCAB = 16, 16, 64, 384
SERVER_ARGS = ("--threads", "1", "--block-size", "16", "--num-blocks", "2048", "--max-requests", "128",
               "--max-batch-tokens", "2048", "--max-seq-len", "256")
PATHS = ("server", "router")
BLOCKS = tuple((path, inflight) for inflight in (1, WIDE) for path in PATHS)


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
    try:
        staging.rename(directory)  # NOTE: atomic, so a killed run never leaves half a model to reuse
    except OSError:  # the other driver saved it first (same seed: the same bytes)
        if not (directory / "config.json").is_file():
            raise


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


async def closed_loop(client, prompts: Prompts, sampling, inflight: int, per_worker: int, digest=None):
    """`inflight` workers, each calling `per_worker` times back to back: (latencies, tokens, wall)."""
    latencies, tokens = [], [0]

    async def worker() -> None:
        for _ in range(per_worker):
            seconds, ids = await timed_call(client, prompts.take(), sampling)
            latencies.append(seconds)
            tokens[0] += len(ids)
            if digest is not None:  # NOTE: only sequential calls: their order is the same in both drivers
                digest.update(repr(ids).encode())

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(inflight)))
    return latencies, tokens[0], time.perf_counter() - start


async def await_router(client) -> None:
    """Requests sent before the router sees its replica up would wait."""
    deadline = time.monotonic() + 60
    while (await client.stats()).get("replicas_up", 0) < 1:
        if time.monotonic() > deadline:
            raise TimeoutError("the router did not see its replica up within 60 s")
        await asyncio.sleep(0.05)


async def serve_blocks(addresses: dict[str, str], args: argparse.Namespace) -> None:
    """Warm both paths, print READY, then run one block per stdin line until "quit"."""
    from inference import SamplingParams
    from rollout import AsyncRolloutClient

    sampling = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts, digest, clients = Prompts(args.seed), hashlib.sha256(), {}
    loop = asyncio.get_running_loop()
    try:
        for path, address in addresses.items():
            clients[path] = client = await AsyncRolloutClient(address, timeout=600, lease_s=600).__aenter__()
            if path == "router":
                await await_router(client)
            await closed_loop(client, prompts, sampling, WIDE, 1)  # warm-up: first steps, connections
            await closed_loop(client, prompts, sampling, 1, 5)
        print(READY_LINE, flush=True)
        while (line := (await loop.run_in_executor(None, sys.stdin.readline)).strip()) not in ("", "quit"):
            path, inflight = json.loads(line)
            count = args.single if inflight == 1 else args.per_worker
            latencies, tokens, wall = await closed_loop(clients[path], prompts, sampling, inflight, count,
                                                        digest if inflight == 1 else None)
            if tokens != inflight * count * MAX_TOKENS:
                raise RuntimeError(f"{path}: {tokens} tokens generated, {inflight * count * MAX_TOKENS} asked")
            print(RESULT_PREFIX + json.dumps({"latencies": latencies, "tokens": tokens, "wall": wall}), flush=True)
        print(RESULT_PREFIX + json.dumps({"digest": digest.hexdigest()[:16]}), flush=True)
    finally:
        for client in clients.values():
            await client.__aexit__(None, None, None)


def driver(args: argparse.Namespace) -> int:
    import rollout
    from rollout import RouterProcess, ServerProcess

    tree = Path.cwd().resolve()
    if not Path(rollout.__file__).resolve().is_relative_to(tree):
        raise RuntimeError(f"`import rollout` resolves to {rollout.__file__}, not inside {tree}")
    if not (args.model_dir / "config.json").is_file():
        save_model(args.model_dir, args.seed)
    with ServerProcess(args.model_dir, *SERVER_ARGS) as server, \
            RouterProcess("--replicas", server.address) as router:
        asyncio.run(serve_blocks({"server": server.address, "router": router.address}, args))
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


class Driver:
    """One commit's driver process, spoken to a line at a time (every read bounded by `timeout`)."""

    def __init__(self, tree: Path, args: argparse.Namespace) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: spinning OpenMP threads starve the other processes
        self.tree, self.timeout = tree, args.timeout
        self.log = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, str(Path(__file__).resolve()), "driver", "--model-dir", str(args.model_dir),
                   "--single", str(args.single), "--per-worker", str(args.per_worker), "--seed", str(args.seed)]
        self.proc = subprocess.Popen(command, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)
        self._lines: asyncio.Queue | None = None

    def _fail(self, why: str) -> RuntimeError:
        self.log.seek(0)
        tail = "\n".join(self.log.read().splitlines()[-30:])
        return RuntimeError(f"the driver in {self.tree} {why}:\n{tail}")

    def read_until(self, prefix: str) -> str:
        import selectors

        deadline = time.monotonic() + self.timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise self._fail(f"said nothing starting {prefix!r} within {self.timeout} s")
                line = self.proc.stdout.readline()
                if not line:
                    raise self._fail(f"exited with {self.proc.wait(10)}")
                if line.startswith(prefix):
                    return line[len(prefix):].strip()

    def block(self, path: str, inflight: int) -> dict:
        self.proc.stdin.write(json.dumps([path, inflight]) + "\n")
        return json.loads(self.read_until(RESULT_PREFIX))

    def finish(self) -> str:
        self.proc.stdin.write("quit\n")
        digest = json.loads(self.read_until(RESULT_PREFIX))["digest"]
        self.proc.stdin.close()
        if self.proc.wait(60) != 0:
            raise self._fail(f"exited with {self.proc.returncode}")
        return digest

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def figures_of(blocks: list[dict], inflight: int) -> dict[str, float]:
    latencies = [v for b in blocks for v in b["latencies"]]
    out = {"p50_ms": 1e3 * percentile(latencies, 0.5), "p99_ms": 1e3 * percentile(latencies, 0.99)}
    if inflight > 1:
        out["tok_s"] = sum(b["tokens"] for b in blocks) / sum(b["wall"] for b in blocks)
    return out


def better_by(name: str, base: float, head: float) -> float:
    """> 1: head is better (latency: base/head; tokens/s: head/base)."""
    return head / base if name.startswith("tok_s") else base / head


def report(rounds: list[dict], labels: dict[str, str], args: argparse.Namespace) -> None:
    """`rounds[i][side][(path, inflight)]`: that round's block result."""
    print(f"\nbase = {labels['base']}, head = {labels['head']}; {len(rounds)} rounds in lockstep; a block: "
          f"{args.single} sequential calls (1 in flight) or {WIDE} workers x {args.per_worker} calls "
          f"({WIDE} in flight); {PROMPT_LEN}-token prompts, {MAX_TOKENS} tokens")
    header = (f"{'figure':<20} {'base':>10} {'head':>10} {'head better by':>14} {'[p10-p90] per round':>21} "
              f"{'all calls pooled':>17}")
    print(header + "\n" + "-" * len(header))
    for path, inflight in BLOCKS:
        pooled = {side: figures_of([r[side][(path, inflight)] for r in rounds], inflight) for side in ("base", "head")}
        per_round = [{side: figures_of([r[side][(path, inflight)]], inflight) for side in ("base", "head")}
                     for r in rounds]
        for stat in pooled["base"]:
            name = f"{stat}[{path},{inflight}]"
            medians = {side: statistics.median(r[side][stat] for r in per_round) for side in ("base", "head")}
            ratio = better_by(name, medians["base"], medians["head"])
            pairs = sorted(better_by(name, r["base"][stat], r["head"][stat]) for r in per_round)
            shown = f"[{percentile(pairs, 0.1):.3f}-{percentile(pairs, 0.9):.3f}]"
            value = (lambda v: f"{v:,.0f}") if stat == "tok_s" else (lambda v: f"{v:.2f}")
            print(f"{name:<20} {value(medians['base']):>10} {value(medians['head']):>10} {ratio:>13.3f}x "
                  f"{shown:>21} {better_by(name, pooled['base'][stat], pooled['head'][stat]):>16.3f}x")
    print("base, head: the median over rounds of each round's figure (a block's p50, p99, tok/s).")
    print("head better by: base/head for latency (ms), head/base for tok/s; > 1 means head is better.")
    print("per round: the same ratio within each round (its base and head blocks ran back to back); "
          "pooled: the ratio of the figures over every call of every round.")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=["compare", "driver"], default="compare",
                        help="driver: one commit's side (what compare runs per commit; commands on stdin)")
    parser.add_argument("--base", default="c1fb8ae", help="the base commit (default c1fb8ae, before the reshape)")
    parser.add_argument("--head", default="HEAD", help="the commit under test (default HEAD)")
    parser.add_argument("--rounds", type=int,
                        help="rounds, each one block per figure per commit (default 30; --quick 3)")
    parser.add_argument("--single", type=int, help="sequential calls per 1-in-flight block (default 25; --quick 5)")
    parser.add_argument("--per-worker", type=int,
                        help=f"calls per worker per {WIDE}-in-flight block (default 8; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 rounds, short blocks")
    parser.add_argument("--seed", type=int, default=0, help="model weights and prompts")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "compare_service",
                        help="extracted trees and the model, reused across runs")
    parser.add_argument("--model-dir", type=Path, help="the model directory (default CACHE/model-seedSEED)")
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent, help="a path in the git repo")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for any one driver answer")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 30)
    args.single = args.single or (5 if args.quick else 25)
    args.per_worker = args.per_worker or (1 if args.quick else 8)
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
    start = time.perf_counter()
    drivers: dict[str, Driver] = {}
    rounds: list[dict] = []
    try:
        for side in ("base", "head"):  # NOTE: one at a time: the first builds the shared model
            drivers[side] = Driver(trees[side], args)
            drivers[side].read_until(READY_LINE)
        for number in range(args.rounds):
            order = ("base", "head") if number % 2 == 0 else ("head", "base")
            results: dict = {"base": {}, "head": {}}
            for block in BLOCKS:
                for side in order:
                    results[side][block] = drivers[side].block(*block)
            rounds.append(results)
            medians = {block: [statistics.median(results[side][block]["latencies"]) for side in ("base", "head")]
                       for block in BLOCKS}
            shown = ", ".join(f"{path},{n} {better_by('p50', *medians[(path, n)]):.3f}" for path, n in BLOCKS)
            print(f"[{number + 1}/{args.rounds}] p50 head better by: {shown}", flush=True)
        digests = {side: d.finish() for side, d in drivers.items()}
    except (RuntimeError, OSError) as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 1
    finally:
        for d in drivers.values():
            d.kill()
    report(rounds, labels, args)
    agree = "agree" if len(set(digests.values())) == 1 else f"DIFFER ({digests}): the commits did not do the same work"
    print(f"total {time.perf_counter() - start:.0f} s; greedy outputs of the sequential calls {agree}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
