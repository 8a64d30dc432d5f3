"""Parallelism across processes (expert parallelism of MoE layers)."""

from inference.parallel.expert_parallel import ExpertParallel, ExpertParallelError, LocalDispatch

__all__ = ["ExpertParallel", "ExpertParallelError", "LocalDispatch"]
