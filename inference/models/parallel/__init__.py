"""Parallelism across processes: expert parallelism of MoE layers (the all-to-all exchanges)."""

from inference.models.parallel.expert_parallel import ExpertParallel, ExpertParallelError

__all__ = ["ExpertParallel", "ExpertParallelError"]
