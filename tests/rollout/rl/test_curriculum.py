"""The prompt curriculum: the task's own draw, reweighted towards what the policy gets wrong."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.rl.curriculum import Curriculum
from rollout.rl.tasks import CountingTask


def test_pool_one_is_the_tasks_own_draw():
    task = CountingTask()
    assert Curriculum(task, pool=1).sample(random.Random(3), 50) == task.sample(random.Random(3), 50)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(1, 64), pool=st.integers(1, 6),
       rewards=st.lists(st.floats(0, 1), min_size=1, max_size=40))
def test_draws_are_training_prompts_only_and_reproducible(seed, count, pool, rewards):
    task = CountingTask()
    held_out = {p.prompt_ids for p in task.held_out()}
    curriculum = Curriculum(task, pool=pool)
    first = curriculum.sample(random.Random(seed), count)
    curriculum.update(first, [i % len(first) for i in range(len(rewards))], rewards)
    again = Curriculum(task, pool=pool)
    again.update(first, [i % len(first) for i in range(len(rewards))], rewards)
    drawn = curriculum.sample(random.Random(seed + 1), count)
    assert len(drawn) == count and not {p.prompt_ids for p in drawn} & held_out
    assert drawn == again.sample(random.Random(seed + 1), count)  # state and seed decide the draw


def test_a_failing_prompt_is_drawn_more_and_at_most_pool_times_as_often():
    task = CountingTask()
    rng = random.Random(0)
    problems = task.sample(rng, 400)
    failing = problems[0].prompt_ids
    curriculum = Curriculum(task, pool=4, floor=0.2)
    # every prompt mastered but one, which scores 0
    curriculum.update(problems, list(range(len(problems))), [0.0 if p.prompt_ids == failing else 1.0 for p in problems])
    base = Counter(p.prompt_ids for p in task.sample(random.Random(1), 20_000))[failing] / 20_000
    drawn = Counter(p.prompt_ids for _ in range(200) for p in curriculum.sample(rng, 100))[failing] / 20_000
    assert 2.5 * base < drawn <= 4 * base * 1.1  # weight 1.2 against 0.2, capped by the pool of 4


def test_unseen_prompts_weigh_as_failing_ones_and_the_average_decays():
    task = CountingTask()
    curriculum = Curriculum(task, floor=0.1, decay=0.5)
    problem = task.sample(random.Random(0), 1)[0]
    assert curriculum.weight(problem) == pytest.approx(1.1)
    curriculum.update([problem], [0, 0], [1.0, 1.0])
    assert curriculum.weight(problem) == pytest.approx(0.1)
    curriculum.update([problem], [0], [0.0])
    assert curriculum.mean_rewards()[problem.prompt_ids] == 0.5 and curriculum.weight(problem) == pytest.approx(0.6)


@pytest.mark.parametrize("kwargs, field", [({"pool": 0}, "pool"), ({"floor": 0}, "floor"), ({"decay": 1.0}, "decay")])
def test_bad_settings_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=f"Curriculum.{field}"):
        Curriculum(CountingTask(), **kwargs)
