"""The GRPO demos over seeds and CPU settings: does the loop learn whatever the rounding?

Each run is `rollout grpo` with its shipped defaults (plus `--seed`) in a fresh process, under one
setting of the CPU's kernels (the environment variables that switch torch's vectorised kernels
and ours, or the x86-64 level our kernels are built for); runs go two at a time on two cores.

    python bench/throughput/demo_seeds.py                                   # tiny: seeds 0-9 x 2 settings
    python bench/throughput/demo_seeds.py --model hybrid-tiny --seeds 0-4
    python bench/throughput/demo_seeds.py --disaggregated --seeds 0-2
    python bench/throughput/demo_seeds.py --settings default,avx2,no-kernels,v2 --seeds 0

Prints one row per (seed, setting): last-10 reward, held-out greedy, the first step whose 10-step
mean reached 0.9 x max, wall time, and whether the run met the bar (both >= 0.95), then a
`RESULT {json}` line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# NOTE: each setting is the environment of a child process: torch reads ATEN_CPU_CAPABILITY at import
SETTINGS = {
    "native": {},
    "default": {"ATEN_CPU_CAPABILITY": "default"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "no-kernels": {"ROLLOUT_ENGINE_NO_KERNELS": "1"},
    "v2": {"ROLLOUT_ENGINE_KERNEL_ARCH": "x86-64-v2"},
    "v3": {"ROLLOUT_ENGINE_KERNEL_ARCH": "x86-64-v3"},
    "2-threads": {"ROLLOUT_ENGINE_DEMO_THREADS": "2"},
}
BAR = 0.95
ROOT = Path(os.environ.get("DEMO_SEEDS_ROOT") or Path(__file__).resolve().parents[2])

CHILD = r"""
import json, os, sys
from rollout.cli import main  # noqa: F401  (the same entry point as `make demo`)
from rollout.rl.colocated import GRPOConfig
args, out = json.loads(sys.argv[1]), sys.argv[2]
threads = os.environ.get("ROLLOUT_ENGINE_DEMO_THREADS")
disaggregated = args.pop("disaggregated")
cfg = GRPOConfig.preset(args.pop("model"), **args, threads=int(threads) if threads else None)
if disaggregated:
    from rollout.rl.disaggregated import run_disaggregated_grpo
    s = run_disaggregated_grpo(cfg).run
else:
    from rollout.rl.colocated import run_grpo
    s = run_grpo(cfg)
json.dump({"final": s.final_reward, "initial": s.initial_reward, "greedy": s.heldout_greedy[1],
           "sampled": s.heldout_sampled[1], "at_target": s.first_step_at_target, "wall": s.wall_seconds,
           "mismatch_max": s.mismatch_max, "stale": s.stale_tokens, "cross": s.cross_version_hits}, open(out, "w"))
"""


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds.extend(range(int(low), int(high or low) + 1))
    return seeds


def run_one(model: str, seed: int, setting: str, disaggregated: bool, steps: int | None, out_dir: Path) -> dict:
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", **SETTINGS[setting]}
    args = {"model": model, "seed": seed, "wandb": False, "progress": False, "out_dir": str(out_dir),
            "run_name": f"{model}-{setting}-s{seed}", "table_every": 1000, "disaggregated": disaggregated}
    if steps is not None:
        args["steps"] = steps
    result = out_dir / f"{model}-{setting}-s{seed}.json"
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args), str(result)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"seed": seed, "setting": setting, "error": proc.stderr[-2000:], "wall": time.perf_counter() - started}
    return {"seed": seed, "setting": setting, **json.loads(result.read_text())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", "hybrid-tiny"])
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--settings", default="default,avx2", help=f"comma-separated, of {sorted(SETTINGS)}")
    parser.add_argument("--disaggregated", action="store_true", help="the disaggregated example instead")
    parser.add_argument("--steps", type=int, default=None, help="override the shipped step count")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one core each)")
    parser.add_argument("--keep", type=Path, default=None, help="keep each run's metrics.jsonl under this folder")
    args = parser.parse_args()
    settings = args.settings.split(",")
    for s in settings:
        if s not in SETTINGS:
            parser.error(f"unknown setting {s!r}; choose from {sorted(SETTINGS)}")
    jobs = [(seed, s) for seed in parse_seeds(args.seeds) for s in settings]
    # NOTE: a disaggregated run is three processes; running two at once would oversubscribe 2 cores
    width = 1 if args.disaggregated else args.jobs
    print(f"{'seed':>4} {'setting':>10} {'last-10':>8} {'greedy':>7} {'0.9max@':>8} {'wall s':>7}  ok")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(width) as pool:
        out_dir = args.keep or Path(tmp)
        futures = [pool.submit(run_one, args.model, seed, s, args.disaggregated, args.steps, out_dir)
                   for seed, s in jobs]
        for future in futures:
            row = future.result()
            rows.append(row)
            if "error" in row:
                print(f"{row['seed']:>4} {row['setting']:>10} FAILED:\n{row['error']}")
                continue
            row["ok"] = row["final"] >= BAR and row["greedy"] >= BAR
            print(f"{row['seed']:>4} {row['setting']:>10} {row['final']:8.3f} {row['greedy']:7.3f} "
                  f"{str(row['at_target']):>8} {row['wall']:7.1f}  {'yes' if row['ok'] else 'NO'}", flush=True)
    passed = sum(bool(r.get("ok")) for r in rows)
    print(f"{passed}/{len(rows)} runs reached last-10 reward >= {BAR} and held-out greedy >= {BAR}")
    print("RESULT " + json.dumps({"model": args.model, "disaggregated": args.disaggregated, "rows": rows}))
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
