"""Verifiable toy tasks: prompts with a known answer and a reward in [0, 1] computed from tokens.

* `CountingTask` (the demo's): a tiny random-init model over a 16-token digit vocabulary sees a run
  of consecutive digits and must continue counting up to 9, then stop. Reward: the length of the
  correct prefix over the longer of answer and completion, so partial counts earn partial credit
  and rambling past the stop is penalised. A random policy scores ~0.02; the maximum is 1.
  NOTE: chosen because its reward is dense: a one-token answer (the issue's "continue counting",
  reward 0.96 in 32 steps) is learnt in seconds, while all-or-nothing multi-token answers
  (0.74 in 700 steps for 3 tokens) and sparse arithmetic (no progress in 4,000) are not.
* `ArithmeticTask`: "What is a + b?" for a chat model (SmolLM2-135M-Instruct): reward 1 when the
  first integer of the answer is the sum, `partial` when the sum comes later. Measured on the
  GGUF-converted SmolLM2 at T=0.7 with one-digit operands: first integer right ~5%, the sum
  anywhere ~37%; with two-digit operands the first is never right.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["ArithmeticTask", "CountingTask", "DigitVocab", "Problem", "Task"]


@dataclass(slots=True, frozen=True)
class Problem:
    """One prompt and what the reward function needs to score completions of it."""

    prompt_ids: tuple[int, ...]
    answer: Any


class Task(Protocol):
    """A verifiable task: sample problems, score token completions (reward in [0, max_reward])."""

    max_tokens: int
    max_reward: float

    @property
    def max_prompt_tokens(self) -> int: ...

    def sample(self, rng: random.Random, count: int) -> list[Problem]: ...

    def reward(self, problem: Problem, completion_ids: list[int]) -> float: ...

    def render(self, problem: Problem, completion_ids: list[int]) -> str: ...


class DigitVocab:
    """Token ids of the counting task: PAD 0, BOS 1, EOS 2, digits '0'..'9' = 3..12; 16 ids in all.

    Ids 13..15 never occur in data; an untrained model can still sample them (shown as '?').
    """

    PAD, BOS, EOS, ZERO = 0, 1, 2, 3
    SIZE = 16

    @classmethod
    def digit(cls, d: int) -> int:
        return cls.ZERO + d

    @classmethod
    def render(cls, ids: list[int] | tuple[int, ...]) -> str:
        out = []
        for t in ids:
            if t == cls.BOS:
                continue
            out.append("." if t == cls.EOS else str(t - cls.ZERO) if cls.ZERO <= t < cls.ZERO + 10 else "?")
        return "".join(out)


@dataclass(slots=True)
class CountingTask:
    """Continue counting up to 9, then EOS: prompt `BOS 3 4`, answer `5 6 7 8 9 EOS`.

    The prompt is `min_run..max_run` consecutive digits ending at most at 8, so every answer has
    1..9 digits plus EOS. `max_tokens` leaves room to overshoot (which the reward penalises).
    """

    min_run: int = 1
    max_run: int = 3
    max_tokens: int = 12
    max_reward: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_run <= self.max_run <= 9:
            raise ValueError(f"CountingTask.min_run/max_run must satisfy 1 <= min <= max <= 9, got "
                             f"{self.min_run}/{self.max_run}")
        if self.max_tokens < 10:
            raise ValueError(f"CountingTask.max_tokens must be >= 10 (the longest answer), got {self.max_tokens}")

    @property
    def max_prompt_tokens(self) -> int:
        return 1 + self.max_run

    def sample(self, rng: random.Random, count: int) -> list[Problem]:
        problems = []
        for _ in range(count):
            run = rng.randint(self.min_run, self.max_run)
            first = rng.randint(0, 9 - run)  # the run ends at 8 at the latest
            digits = list(range(first, first + run))
            prompt = (DigitVocab.BOS, *(DigitVocab.digit(d) for d in digits))
            answer = tuple(DigitVocab.digit(d) for d in range(digits[-1] + 1, 10)) + (DigitVocab.EOS,)
            problems.append(Problem(prompt, answer))
        return problems

    def reward(self, problem: Problem, completion_ids: list[int]) -> float:
        answer = problem.answer
        correct = 0
        for got, want in zip(completion_ids, answer):
            if got != want:
                break
            correct += 1
        return correct / max(len(answer), len(completion_ids))

    def render(self, problem: Problem, completion_ids: list[int]) -> str:
        return f"{DigitVocab.render(problem.prompt_ids)} -> {DigitVocab.render(completion_ids)}"


_INT = re.compile(r"-?\d+")


@dataclass(slots=True)
class ArithmeticTask:
    """"What is a + b?" through a chat template; reward 1 if the first integer answered is a + b,
    `partial` if a later one is, else 0."""

    tokenizer: Any
    low: int = 0
    high: int = 9
    max_tokens: int = 12
    max_reward: float = 1.0
    partial: float = 0.5

    @property
    def max_prompt_tokens(self) -> int:
        return len(self._encode(-(10 ** len(str(self.high))), -(10 ** len(str(self.high))))) + 4

    def _encode(self, a: int, b: int) -> tuple[int, ...]:
        messages = [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # a BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return tuple(int(t) for t in ids)

    def sample(self, rng: random.Random, count: int) -> list[Problem]:
        problems = []
        for _ in range(count):
            a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
            problems.append(Problem(self._encode(a, b), a + b))
        return problems

    def reward(self, problem: Problem, completion_ids: list[int]) -> float:
        numbers = [int(m) for m in _INT.findall(self.tokenizer.decode(completion_ids, skip_special_tokens=True))]
        if numbers and numbers[0] == problem.answer:
            return 1.0
        return self.partial if problem.answer in numbers else 0.0

    def render(self, problem: Problem, completion_ids: list[int]) -> str:
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True).strip().replace("\n", " ")
        return f"{problem.answer} <- {text!r}"
