"""Colocated GRPO on a laptop-class CPU: a trainer and the engine in one process, same memory.

    python examples/grpo_colocated.py                   # the demo: ~1 min on 2 cores (58.6 s measured)
    python examples/grpo_colocated.py --model smollm2   # SmolLM2-135M-Instruct on "a + b" (slow)
    python examples/grpo_colocated.py --model smollm2 --lora 16   # ... training a rank-16 LoRA (PEFT)
    python examples/grpo_colocated.py --help

A 2-layer Llama (hidden 64) from random init learns to continue counting up to 9 and stop
(`3 4 -> 5 6 7 8 9 <eos>`), by GRPO alone, from a random-policy reward of ~0.01 to ~1.0. Each step:

    engine.resume()                                   # re-allocate the KV buffer
    batch = engine.generate(prompts, n=8, sampling)   # RolloutBatch: ids, log-probs, versions
    rewards = [task.reward(...) for r in batch]
    engine.suspend()                                  # KV buffer freed for the trainer
    grpo_step(policy, optimizer, batch, rewards)      # the engine aliases `policy`'s parameters
    engine.on_weights_updated()                       # version + 1, prefix cache reset; no copy

Every 10 steps it also measures the reward on held-out prompts the loop never trains on, greedy
and sampled. The loop itself is `rollout.rl.colocated.run_grpo` (also `rollout grpo`). Metrics go to
W&B (offline unless WANDB_MODE=online), to the console, to `runs/<name>/metrics.jsonl` and to a
PNG of training and held-out reward and train-inference mismatch against step; the paths are
printed at the end.
"""

from __future__ import annotations

import sys

from rollout.cli import main

if __name__ == "__main__":
    sys.exit(main(["grpo", *sys.argv[1:]]))
