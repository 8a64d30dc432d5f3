"""Colocated GRPO on SmolLM2: a LoRA adapter (`rollout grpo --lora R`) against full fine-tuning,
same task (arithmetic), same seed, same steps, same prompts at step 0.

    python bench/lora/lora_grpo.py                          # rank 16, 12 steps each, curve every 2 steps
    python bench/lora/lora_grpo.py --steps 30 --every 5     # the preset's 30 steps (long on 2 busy cores)
    python bench/lora/lora_grpo.py --sweep 2e-4,5e-4,1e-3,2e-3 --steps 8   # LoRA learning rates only

Both runs are `run_grpo(GRPOConfig.preset("smollm2", ...))` in this process, one after the other
(full fine-tuning first), each with its preset learning rate (full: 5e-6; LoRA: the preset's, or
`--lora-lr`) and one torch thread. Prints the training reward side by side (the mean of each
window of `--every` steps), the held-out reward (greedy, prompts never trained on) first and last,
wall time (total, and per-step medians of the step and of its generate / train phases), the
LoRA / full ratios, the loop's checks (stale tokens, cross-version hits, trainer mismatch), then
a `RESULT {json}` line. NOTE: runs are not interleaved: the load average is printed per run,
since other processes on a shared machine move both figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench/common.py

from bench.common import machine_line, print_result  # noqa: E402
from rollout.rl.colocated import GRPOConfig, RunSummary, run_grpo  # noqa: E402

PHASES = ("generate", "train", "eval")


def run(label: str, steps: int, seed: int, out_dir: str, *, rank: int | None, lr: float | None,
        eval_every: int) -> tuple[RunSummary, float, str]:
    cfg = GRPOConfig.preset("smollm2", steps=steps, seed=seed, lora_rank=rank, lr=lr, threads=1, wandb=False,
                            progress=False, eval_every=eval_every, table_every=steps, out_dir=out_dir, run_name=label)
    start = time.perf_counter()
    summary = run_grpo(cfg)
    return summary, time.perf_counter() - start, f"{label}: lr {cfg.lr:g}, {machine_line()}"


def step_seconds(s: RunSummary) -> list[float]:
    return [sum(v for k, v in h.items() if k.startswith("time/")) for h in s.history]


def phase_median(s: RunSummary, phase: str) -> float:
    values = [h[f"time/{phase}"] for h in s.history if f"time/{phase}" in h]
    return statistics.median(values) if values else float("nan")


def window_means(s: RunSummary, every: int) -> list[tuple[int, float]]:
    rewards = [h["reward"] for h in s.history]
    return [(end - 1, sum(rewards[end - every:end]) / every) for end in range(every, len(rewards) + 1, every)]


def compare(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as out:
        full, full_wall, full_line = run("full", args.steps, args.seed, out, rank=None, lr=None,
                                         eval_every=args.eval_every)
        lora, lora_wall, lora_line = run(f"lora-r{args.rank}", args.steps, args.seed, out, rank=args.rank,
                                         lr=args.lora_lr, eval_every=args.eval_every)
    print(f"SmolLM2-135M-Instruct, arithmetic, colocated GRPO, {args.steps} steps, seed {args.seed}, "
          f"8 prompts x 8 samples a step")
    print(full_line)
    print(lora_line)
    print(f"\n{'steps':>9}  {'full FT reward':>14}  {f'LoRA r{args.rank} reward':>16}")
    for (step, f), (_, r) in zip(window_means(full, args.every), window_means(lora, args.every)):
        print(f"{step - args.every + 1:>4}-{step:<4}  {f:>14.3f}  {r:>16.3f}")
    for name, s in (("full FT", full), (f"LoRA r{args.rank}", lora)):
        print(f"{name:>9}: reward {s.initial_reward:.3f} at step 0 -> {s.final_reward:.3f} (last 10 steps); held-out "
              f"greedy {s.heldout_greedy[0]:.3f} -> {s.heldout_greedy[1]:.3f}; mismatch max {s.mismatch_max:.1e}; "
              f"stale tokens {s.stale_tokens}; cross-version hits {s.cross_version_hits}")
    f_step, l_step = statistics.median(step_seconds(full)), statistics.median(step_seconds(lora))
    print(f"\nwall time: full {full_wall:.1f} s, LoRA {lora_wall:.1f} s: LoRA / full = {lora_wall / full_wall:.2f}x")
    print(f"per-step median: full {f_step:.2f} s, LoRA {l_step:.2f} s: {l_step / f_step:.2f}x")
    figures = {"wall_ratio": lora_wall / full_wall, "step_ratio": l_step / f_step, "full_wall_s": full_wall,
               "lora_wall_s": lora_wall, "full_final_reward": full.final_reward, "lora_final_reward": lora.final_reward,
               "full_initial_reward": full.initial_reward, "lora_initial_reward": lora.initial_reward,
               "full_mismatch_max": full.mismatch_max, "lora_mismatch_max": lora.mismatch_max}
    for phase in PHASES:
        f, r = phase_median(full, phase), phase_median(lora, phase)
        print(f"  {phase:>8} median: full {f:.2f} s, LoRA {r:.2f} s: {r / f:.2f}x")
        figures[f"{phase}_ratio"] = r / f
    print_result("lora_grpo", figures, steps=args.steps, rank=args.rank, seed=args.seed,
                 full_rewards=[h["reward"] for h in full.history], lora_rewards=[h["reward"] for h in lora.history])
    return 0


def sweep(args: argparse.Namespace) -> int:
    """LoRA runs at each learning rate: how to choose the preset's (the reward it reaches in `--steps`)."""
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for lr in (float(x) for x in args.sweep.split(",")):
            s, wall, line = run(f"lora-r{args.rank}-lr{lr:g}", args.steps, args.seed, out, rank=args.rank, lr=lr,
                                eval_every=args.eval_every)
            rewards = [h["reward"] for h in s.history]
            rows.append((lr, rewards, wall))
            print(f"{line}\n  lr {lr:g}: rewards {' '.join(f'{r:.2f}' for r in rewards)}; mismatch max "
                  f"{s.mismatch_max:.1e}; {wall:.0f} s", flush=True)
    best = max(rows, key=lambda row: sum(row[1][len(row[1]) // 2:]))
    print(f"best (mean reward of the second half): lr {best[0]:g}")
    print_result("lora_grpo_sweep", {f"lr{lr:g}_late_reward": sum(r[len(r) // 2:]) / len(r[len(r) // 2:])
                                     for lr, r, _ in rows}, rank=args.rank, steps=args.steps)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="steps of each run (12; the preset's default is 30)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (16)")
    p.add_argument("--lora-lr", type=float, help="LoRA learning rate (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=int, default=2, help="reward curve: the mean of each window of k steps (2)")
    p.add_argument("--eval-every", type=int, default=1000, help="held-out reward every k steps (and at the last; "
                   "default: first and last only)")
    p.add_argument("--sweep", help="comma-separated LoRA learning rates: sweep them instead of comparing")
    args = p.parse_args(argv)
    return sweep(args) if args.sweep else compare(args)


if __name__ == "__main__":
    sys.exit(main())
