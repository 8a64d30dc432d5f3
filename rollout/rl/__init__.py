"""RL applications on the backends: GRPO, tasks, the colocated and disaggregated loops, tracking."""
