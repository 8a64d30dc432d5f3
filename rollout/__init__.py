"""What an RL loop talks to: rollouts as plain data, a colocated engine wrapper, GRPO pieces."""

from rollout.colocated import GRPOConfig, ModelKind, RunSummary, run_grpo
from rollout.engine import RolloutEngine
from rollout.grpo import TrainStats, gather_logprobs, group_advantages, grpo_loss, grpo_step, token_logprobs
from rollout.tasks import ArithmeticTask, CountingTask, DigitVocab, Problem, Task
from rollout.types import FinishReason, GenerationStats, PaddedBatch, Rollout, RolloutBatch

__all__ = [
    "ArithmeticTask",
    "CountingTask",
    "DigitVocab",
    "FinishReason",
    "GRPOConfig",
    "GenerationStats",
    "ModelKind",
    "PaddedBatch",
    "Problem",
    "Rollout",
    "RolloutBatch",
    "RolloutEngine",
    "RunSummary",
    "Task",
    "TrainStats",
    "gather_logprobs",
    "group_advantages",
    "grpo_loss",
    "grpo_step",
    "run_grpo",
    "token_logprobs",
]
