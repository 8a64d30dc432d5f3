"""The colocated GRPO demo with and without speculative decoding: the same learning, less generation time.

Runs `rollout.rl.colocated.run_grpo` twice from the same seed, speculation off then on (then off
and on again with `--repeats 2`), and prints the reward curves side by side (every `--every` steps,
10-step means) and the generation time of each run, with the ratio off / on. Speculation is
lossless, so the runs sample the same tokens up to floating-point batch effects: the curves
should agree closely (each step's tokens feed the next step's weights, so one flipped token
makes the runs drift apart from there on, as two seeds would not).

Usage: `python bench/speculation/speculative_demo.py [--model tiny|smollm2] [--steps 200] [--repeats 1]`.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: before torch loads OpenMP; see common.py
os.environ.setdefault("WANDB_MODE", "offline")

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from bench.common import median, print_result  # noqa: E402
from rollout.rl.colocated import GRPOConfig, run_grpo  # noqa: E402


def one_run(model: str, steps: int, speculative: bool, out_dir: str):
    cfg = GRPOConfig.preset(model, steps=steps, speculative=speculative, wandb=False, progress=False,
                            out_dir=out_dir, run_name=f"spec-{speculative}", table_every=10 ** 6)
    summary = run_grpo(cfg)
    return summary, sum(h.get("time/generate", 0.0) for h in summary.history)


def window_mean(history: list[dict], step: int) -> float:
    """Mean reward of the 10 steps ending at `step`."""
    window = history[max(0, step - 9) : step + 1]
    return sum(h["reward"] for h in window) / len(window)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()
    gen = {False: [], True: []}
    runs = {}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.repeats):
            for speculative in (False, True):
                summary, seconds = one_run(args.model, args.steps, speculative, out)
                gen[speculative].append(seconds)
                runs[speculative] = summary
    off, on = runs[False].history, runs[True].history
    print(f"{'step':>5} {'reward off':>11} {'reward on':>10}")
    for step in range(args.every - 1, len(off), args.every):
        print(f"{step + 1:>5} {window_mean(off, step):>11.3f} {window_mean(on, step):>10.3f}")
    ratio = median([a / b for a, b in zip(gen[False], gen[True])])
    print(f"final reward (last 10 steps): off {runs[False].final_reward:.3f}, on {runs[True].final_reward:.3f}; "
          f"generation time: off {median(gen[False]):.1f} s, on {median(gen[True]):.1f} s ({ratio:.2f}x); "
          f"wall: off {runs[False].wall_seconds:.1f} s, on {runs[True].wall_seconds:.1f} s")
    print_result("speculative_demo", {"final_reward_off": runs[False].final_reward,
                                      "final_reward_on": runs[True].final_reward,
                                      "generate_s_off": median(gen[False]), "generate_s_on": median(gen[True]),
                                      "generate_ratio": ratio}, model=args.model, steps=args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
