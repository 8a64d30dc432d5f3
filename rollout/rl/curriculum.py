"""A curriculum over a task's prompts: practise most what the policy does worst.

`Curriculum.sample` draws `pool` times the prompts it needs from the task's own sampler (so the
task, its distribution and its held-out prompts stay as they are), then keeps `count` of them
without replacement, each with weight `floor + deficit`: the deficit is how far the prompt's
recent mean reward (an exponential average over the steps it was drawn in) is below the task's
maximum, a prompt never seen counting as one scoring 0. `update` feeds each step's rewards back.

NOTE: why the loop needs it. GRPO's advantages are relative to the group, so a group whose
samples all scored alike (`signal_fraction` counts the others) exerts no force at all. A prompt
the policy gets wrong while generalisation from the other prompts pushes it further wrong (the
demo's "1 -> <eos>", learnt from "9 -> <eos>") sinks into a deterministic wrong answer with
nothing to pull it back: its 8 samples agree, its advantages are 0, and the correct token's
probability (1e-4 when measured) is never sampled again. Drawing such a prompt more often while
its reward falls keeps its own gradient, which opposes the drift, as strong as the drift.
With `pool = 1` the curriculum is off: the task's own draw, in its order.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from rollout.rl.tasks import Problem, Task

__all__ = ["Curriculum"]


@dataclass(slots=True)
class Curriculum:
    task: Task
    pool: int = 4  # candidates drawn per prompt kept: a prompt is at most `pool` times more frequent
    floor: float = 0.05  # weight of a prompt at the maximum reward (so mastered prompts keep being seen)
    decay: float = 0.5  # weight of the old average against a new step's mean
    _mean: dict[Hashable, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.pool, int) or self.pool < 1:
            raise ValueError(f"Curriculum.pool must be an int >= 1, got {self.pool!r}")
        if not self.floor > 0:
            raise ValueError(f"Curriculum.floor must be > 0, got {self.floor!r}")
        if not 0 <= self.decay < 1:
            raise ValueError(f"Curriculum.decay must be in [0, 1), got {self.decay!r}")

    def weight(self, problem: Problem) -> float:
        mean = self._mean.get(problem.prompt_ids, 0.0)
        return self.floor + max(0.0, self.task.max_reward - mean) / self.task.max_reward

    def sample(self, rng: random.Random, count: int) -> list[Problem]:
        candidates = self.task.sample(rng, count * self.pool)
        if self.pool == 1:
            return candidates
        # weighted sampling without replacement (Efraimidis-Spirakis: the `count` largest u^(1/w))
        keys = [rng.random() ** (1.0 / self.weight(p)) for p in candidates]
        order = sorted(range(len(candidates)), key=keys.__getitem__, reverse=True)[:count]
        return [candidates[i] for i in sorted(order)]

    def update(self, problems: Sequence[Problem], groups: Sequence[int], rewards: Sequence[float]) -> None:
        """One step's rewards (`groups[i]` indexes `problems` for sample i)."""
        sums: dict[int, list[float]] = {}
        for g, r in zip(groups, rewards):
            sums.setdefault(g, []).append(r)
        for g, values in sums.items():
            key = problems[g].prompt_ids
            mean = sum(values) / len(values)
            old = self._mean.get(key)
            self._mean[key] = mean if old is None else self.decay * old + (1 - self.decay) * mean

    def mean_rewards(self) -> dict[Hashable, float]:
        return dict(self._mean)
