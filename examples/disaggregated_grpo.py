"""Disaggregated GRPO: the trainer in this process, two engine replicas in processes of their own.

    python examples/disaggregated_grpo.py                   # on-policy: generate, train, sync in turn
    python examples/disaggregated_grpo.py --off-policy 1    # generation of step k+1 overlaps training on k
    python examples/disaggregated_grpo.py --transport shm --replicas 3
    python examples/disaggregated_grpo.py --replica-dtype bfloat16 --delta   # bf16 replicas, delta syncs
    python examples/disaggregated_grpo.py --help

The colocated demo's task (a 2-layer Llama learns to continue counting up to 9) with the engines
as `rollout serve` replicas. Every step the trainer's new weights travel to every replica
(`weight_sync.WeightSender`: a manifest, buckets with checksums over a gloo broadcast, one commit
per replica) before the next generation. Each step checks that every token was sampled by the
version the trainer planned, and the run ends by checking that every replica's greedy outputs
equal those of a fresh engine of the trainer's final weights. The loop is
`rollout.rl.disaggregated.run_disaggregated_grpo` (also `rollout grpo --disaggregated`).
"""

from __future__ import annotations

import sys

from rollout.cli import main

if __name__ == "__main__":
    sys.exit(main(["grpo", "--disaggregated", *sys.argv[1:]]))
