"""What an RL loop talks to: rollouts as plain data, one backend interface (in process or over
ZMQ), GRPO pieces."""

from rollout.aclient import AsyncRolloutClient
from rollout.backend import RolloutBackend, SampleStream
from rollout.client import RolloutClient
from rollout.colocated import GRPOConfig, ModelKind, RunSummary, run_grpo
from rollout.curriculum import Curriculum
from rollout.engine import RolloutEngine
from rollout.grpo import (
    TrainStats,
    gather_logprobs,
    group_advantages,
    grpo_loss,
    grpo_step,
    shortfall_entropy,
    token_logprobs,
)
from rollout.launch import ServerProcess
from rollout.route import RouterProcess
from rollout.router import RolloutRouter, RouterConfig
from rollout.security import ClientSecurity, ServerSecurity
from rollout.tasks import ArithmeticTask, CountingTask, DigitVocab, Problem, Task
from rollout.types import FinishReason, GenerationStats, PaddedBatch, Rollout, RolloutBatch, TokenChunk

__all__ = [
    "ArithmeticTask",
    "AsyncRolloutClient",
    "ClientSecurity",
    "CountingTask",
    "Curriculum",
    "DigitVocab",
    "FinishReason",
    "GRPOConfig",
    "GenerationStats",
    "ModelKind",
    "PaddedBatch",
    "Problem",
    "Rollout",
    "RolloutBackend",
    "RolloutBatch",
    "RolloutClient",
    "RolloutEngine",
    "RolloutRouter",
    "RouterConfig",
    "RouterProcess",
    "RunSummary",
    "SampleStream",
    "ServerProcess",
    "ServerSecurity",
    "Task",
    "TokenChunk",
    "TrainStats",
    "gather_logprobs",
    "group_advantages",
    "grpo_loss",
    "grpo_step",
    "run_grpo",
    "shortfall_entropy",
    "token_logprobs",
]
