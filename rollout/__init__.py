"""What an RL loop talks to: rollouts as plain data, one backend interface (in process or over
ZMQ), GRPO pieces."""

from rollout.backend import RolloutBackend, SampleStream
from rollout.client.aio import AsyncRolloutClient
from rollout.client.sync import RolloutClient
from rollout.local import RolloutEngine
from rollout.rl.colocated import GRPOConfig, ModelKind, RunSummary, run_grpo
from rollout.rl.curriculum import Curriculum
from rollout.rl.grpo import (
    TrainStats,
    gather_logprobs,
    group_advantages,
    grpo_loss,
    grpo_step,
    shortfall_entropy,
    token_logprobs,
)
from rollout.rl.tasks import ArithmeticTask, CountingTask, DigitVocab, Problem, Task
from rollout.router.process import RouterProcess
from rollout.router.router import RolloutRouter, RouterConfig
from rollout.server.process import ServerProcess
from rollout.types import FinishReason, GenerationStats, PaddedBatch, Rollout, RolloutBatch, TokenChunk
from rollout.wire.security import ClientSecurity, ServerSecurity

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
