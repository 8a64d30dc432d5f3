"""Verifiable toy tasks: prompts with a known answer and a reward in [0, 1] computed from tokens.

* `CountingTask` (the demo's): a tiny random-init model over a 16-token digit vocabulary sees a run
  of consecutive digits and must continue counting up to 9, then stop. Reward: the length of the
  correct prefix over the longer of answer and completion, so partial counts earn partial credit
  and rambling past the stop is penalised. A random policy scores ~0.02; the maximum is 1.
  NOTE: chosen because its reward is dense: a one-token answer (the issue's "continue counting",
  reward 0.96 in 32 steps) is learnt in seconds, while all-or-nothing multi-token answers
  (0.74 in 700 steps for 3 tokens) and sparse arithmetic (no progress in 4,000) are not.
* Each task holds out a fixed, seeded sample of its prompts (`held_out()`) that `sample` never
  draws: the loop's held-out reward measures what it learnt, not what it memorised.
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


HELD_OUT_SEED = 1234  # fixes which prompts are held out, whatever the run's seed


class Task(Protocol):
    """A verifiable task: sample training problems, list held-out ones, score token completions
    (reward in [0, max_reward]). `sample` never returns a held-out prompt."""

    max_tokens: int
    max_reward: float

    @property
    def max_prompt_tokens(self) -> int: ...

    def sample(self, rng: random.Random, count: int) -> list[Problem]: ...

    def held_out(self) -> list[Problem]: ...

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
    `num_held_out` of the distinct prompts (24 with the defaults) are never trained on; they are
    runs of two digits or more, so a training prompt ends on each one's last digit: the held-out
    reward measures counting on from an unseen prompt, not from a digit never seen last.
    """

    min_run: int = 1
    max_run: int = 3
    max_tokens: int = 12
    max_reward: float = 1.0
    num_held_out: int = 6

    def __post_init__(self) -> None:
        if not 1 <= self.min_run <= self.max_run <= 9:
            raise ValueError(f"CountingTask.min_run/max_run must satisfy 1 <= min <= max <= 9, got "
                             f"{self.min_run}/{self.max_run}")
        if self.max_tokens < 10:
            raise ValueError(f"CountingTask.max_tokens must be >= 10 (the longest answer), got {self.max_tokens}")
        longer = len(self._longer_runs())
        # NOTE: at least one prompt must stay for training (min_run >= 2 makes every prompt "longer")
        longer -= int(longer == sum(10 - run for run in range(self.min_run, self.max_run + 1)))
        if not 0 <= self.num_held_out <= longer:
            raise ValueError(f"CountingTask.num_held_out must be in [0, {longer}] (the prompts of two digits or "
                             f"more), got {self.num_held_out}")

    @property
    def max_prompt_tokens(self) -> int:
        return 1 + self.max_run

    def sample(self, rng: random.Random, count: int) -> list[Problem]:
        held_out = {p.prompt_ids for p in self.held_out()}
        problems: list[Problem] = []
        while len(problems) < count:
            run = rng.randint(self.min_run, self.max_run)
            problem = self._problem(rng.randint(0, 9 - run), run)  # the run ends at 8 at the latest
            if problem.prompt_ids not in held_out:
                problems.append(problem)
        return problems

    def held_out(self) -> list[Problem]:
        return random.Random(HELD_OUT_SEED).sample(self._longer_runs(), self.num_held_out)

    def _longer_runs(self) -> list[Problem]:
        return [self._problem(first, run) for run in range(max(2, self.min_run), self.max_run + 1)
                for first in range(10 - run)]

    @staticmethod
    def _problem(first: int, run: int) -> Problem:
        digits = range(first, first + run)
        prompt = (DigitVocab.BOS, *(DigitVocab.digit(d) for d in digits))
        answer = tuple(DigitVocab.digit(d) for d in range(first + run, 10)) + (DigitVocab.EOS,)
        return Problem(prompt, answer)

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
    `partial` if a later one is, else 0. `num_held_out` (a, b) pairs are never trained on."""

    tokenizer: Any
    low: int = 0
    high: int = 9
    max_tokens: int = 12
    max_reward: float = 1.0
    partial: float = 0.5
    num_held_out: int = 8

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
        held_out = set(self._held_out_pairs())
        problems = []
        while len(problems) < count:
            a, b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
            if (a, b) not in held_out:
                problems.append(Problem(self._encode(a, b), a + b))
        return problems

    def held_out(self) -> list[Problem]:
        return [Problem(self._encode(a, b), a + b) for a, b in self._held_out_pairs()]

    def _held_out_pairs(self) -> list[tuple[int, int]]:
        pairs = [(a, b) for a in range(self.low, self.high + 1) for b in range(self.low, self.high + 1)]
        return random.Random(HELD_OUT_SEED).sample(pairs, min(self.num_held_out, len(pairs) - 1))

    def reward(self, problem: Problem, completion_ids: list[int]) -> float:
        numbers = [int(m) for m in _INT.findall(self.tokenizer.decode(completion_ids, skip_special_tokens=True))]
        if numbers and numbers[0] == problem.answer:
            return 1.0
        return self.partial if problem.answer in numbers else 0.0

    def render(self, problem: Problem, completion_ids: list[int]) -> str:
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True).strip().replace("\n", " ")
        return f"{problem.answer} <- {text!r}"
