"""The counting task's prompts and its verifiable reward."""

from __future__ import annotations

import random
import re

import pytest

from rollout.rl.tasks import ArithmeticTask, CountingTask, DigitVocab, Problem

D, EOS = DigitVocab.digit, DigitVocab.EOS


def test_sampled_problems_count_up_to_nine():
    task = CountingTask()
    for problem in task.sample(random.Random(0), 200):
        digits = [t - DigitVocab.ZERO for t in problem.prompt_ids[1:]]
        assert problem.prompt_ids[0] == DigitVocab.BOS
        assert task.min_run <= len(digits) <= task.max_run and digits[-1] <= 8
        assert digits == list(range(digits[0], digits[0] + len(digits)))
        assert list(problem.answer) == [D(d) for d in range(digits[-1] + 1, 10)] + [EOS]
        assert len(problem.prompt_ids) <= task.max_prompt_tokens
        assert len(problem.answer) <= task.max_tokens


def test_reward_is_the_correct_prefix_over_the_longer_sequence():
    task = CountingTask()
    p = Problem((DigitVocab.BOS, D(6)), (D(7), D(8), D(9), EOS))
    assert task.reward(p, [D(7), D(8), D(9), EOS]) == 1.0
    assert task.reward(p, [D(7), D(8)]) == 0.5  # stopped (max_tokens) half-way
    assert task.reward(p, [D(7), D(3), D(9), EOS]) == 0.25  # credit stops at the first error
    assert task.reward(p, [D(7), D(8), D(9), D(0), D(1), D(2), D(3), EOS]) == 3 / 8  # overshoot is penalised
    assert task.reward(p, []) == 0.0
    assert task.reward(p, [EOS]) == 0.0


def test_render_and_config_checks():
    task = CountingTask()
    p = Problem((DigitVocab.BOS, D(7)), (D(8), D(9), EOS))
    assert task.render(p, [D(8), D(9), EOS]) == "7 -> 89."
    assert DigitVocab.render([15]) == "?"
    with pytest.raises(ValueError, match="min_run"):
        CountingTask(min_run=0)
    with pytest.raises(ValueError, match="max_tokens"):
        CountingTask(max_tokens=5)


class CharTokenizer:
    """Characters as token ids; a chat template that is the message itself."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [ord(c) for c in messages[0]["content"]]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_arithmetic_reward_prefers_the_sum_first():
    task = ArithmeticTask(CharTokenizer())
    problem = task.sample(random.Random(1), 1)[0]
    a, b = (int(v) for v in re.findall(r"\d+", CharTokenizer().decode(problem.prompt_ids)))
    assert problem.answer == a + b and len(problem.prompt_ids) <= task.max_prompt_tokens
    enc = lambda s: [ord(c) for c in s]  # noqa: E731
    assert task.reward(problem, enc(f"{a + b}")) == 1.0
    assert task.reward(problem, enc(f"{a} + {b} = {a + b}")) == task.partial
    assert task.reward(problem, enc(f"{a + b + 1}")) == 0.0
    assert task.reward(problem, enc("no idea")) == 0.0


def test_held_out_prompts_are_fixed_and_never_sampled():
    task = CountingTask()
    held_out = {p.prompt_ids for p in task.held_out()}
    assert len(held_out) == task.num_held_out == 6 and held_out == {p.prompt_ids for p in CountingTask().held_out()}
    assert all(len(prompt) >= 3 for prompt in held_out)  # two digits or more: each last digit ends a training prompt
    trained = {p.prompt_ids for p in task.sample(random.Random(3), 2000)}
    assert not trained & held_out and len(trained) == 24 - 6
    with pytest.raises(ValueError, match="num_held_out"):
        CountingTask(num_held_out=16)
    arithmetic = ArithmeticTask(CharTokenizer())
    held = {p.prompt_ids for p in arithmetic.held_out()}
    assert len(held) == arithmetic.num_held_out
    assert not {p.prompt_ids for p in arithmetic.sample(random.Random(4), 500)} & held
