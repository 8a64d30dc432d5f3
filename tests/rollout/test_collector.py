"""`SampleCollector`, the bookkeeping under every sample stream, driven by random event sequences."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.collector import SampleCollector


@settings(max_examples=200, deadline=None)
@given(owed=st.lists(st.integers(1, 4), min_size=1, max_size=5), seed=st.integers(0, 2**32 - 1),
       refused=st.none() | st.integers(0, 4))
def test_each_sample_counts_once_and_an_abort_targets_exactly_the_requests_still_owing(owed, seed, refused):
    """Against a plain model: every (request, sample) delivered in a random order, each a random
    number of times (resubmissions repeat them), one request maybe refused part way."""
    rng = random.Random(seed)
    ids = [f"r{i}" for i in range(len(owed))]
    collector = SampleCollector(ids, owed, timeout=None)
    events = [(g, i) for g, n in enumerate(owed) for i in range(n) for _ in range(rng.randint(1, 3))]
    rng.shuffle(events)
    refused = None if refused is None or refused >= len(owed) else refused
    cut = rng.randint(0, len(events))
    counted: set[tuple[int, int]] = set()
    for step, (group, index) in enumerate(events):
        if step == cut and refused is not None:
            collector.refuse(refused)
        if step >= cut and group == refused:
            continue  # NOTE: a refused request sends nothing more
        new = collector.take(group, index)
        assert new == ((group, index) not in counted)
        counted.add((group, index))
        assert collector.taken(group, index)
    expected_left = {g: 0 if g == refused and cut < len(events) else n - sum(1 for c in counted if c[0] == g)
                     for g, n in enumerate(owed)}
    assert [collector.left(g) for g in range(len(owed))] == [expected_left[g] for g in range(len(owed))]
    owing = [ids[g] for g in range(len(owed)) if expected_left[g] > 0]
    assert collector.unfinished() == owing
    assert collector.done == (len(counted) == sum(owed))
    assert collector.give_up() == owing and collector.done  # giving up ends the stream, the abort targets stay


def test_the_deadline_is_brought_in_never_pushed_out():
    collector = SampleCollector(["a"], [1], timeout=60.0)
    first = collector.deadline
    collector.within(120.0)
    assert collector.deadline == first and collector.timeout == 60.0
    collector.within(0.0)
    assert collector.deadline < first and collector.timeout == 0.0
    time.sleep(0.01)
    assert collector.wait_s() == 0.0 and collector.expired()
    unbounded = SampleCollector([1, 2], [1, 1], timeout=None)
    assert unbounded.wait_s() is None and not unbounded.expired()
    with pytest.raises(ValueError, match="2 requests, 1 counts"):
        SampleCollector(["a", "b"], [1], timeout=None)
