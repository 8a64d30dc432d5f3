"""The step cost model and the choice of how many proposals a verify step carries."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.speculation.costs import StepCosts


def test_estimates_interpolate_hold_and_never_fall():
    costs = StepCosts(16)
    assert (costs.estimates() == 1.0).all()  # nothing measured: every size alike
    costs.record(4, 0.010)
    costs.record(12, 0.030)
    costs.record(8, 0.050)  # a slow outlier between: it does not raise the counts above it
    est = costs.estimates()
    assert est[1] == est[4] == 0.010  # below the smallest record: that one's
    assert est[8] == 0.030 and abs(est[6] - 0.030) < 1e-12 and abs(est[5] - 0.020) < 1e-12  # capped by 12
    assert est[12] == est[16] == 0.030  # above the largest: held (untried sizes get tried)
    for t in (0.040, 0.040, 3.0):  # a median over the recent steps: one slow step moves nothing
        costs.record(12, t)
    assert costs.estimates()[12] == 0.040
    for _ in range(9):  # the window forgets: only the last 9 steps count
        costs.record(12, 0.020)
    assert costs.estimates()[12] == 0.020
    costs.record(17, 9.0)  # beyond max_tokens: ignored
    assert costs.estimates()[16] == 0.020


def test_flat_costs_take_every_proposal_up_to_the_budget():
    costs = StepCosts(10, measured=False)
    costs.record(4, 123.0)
    assert costs.best_extra(4, np.array([0.9, 0.5, 0.1, 0.05, 0.01, 0.01, 0.01])) == 6  # 4 rows + 6 = 10
    assert costs.best_extra(10, np.array([0.9])) == 0


def test_measured_costs_stop_where_a_token_costs_more_than_it_brings():
    costs = StepCosts(32)
    for n in range(1, 33):  # flat to 8 tokens, then linear: a CPU's shape
        costs.record(n, 0.05 * max(1.0, n / 8))
    # 2 rows: proposals up to 6 more tokens are free, past them one costs 1/8 of a step's time per token
    assert costs.best_extra(2, np.full(20, 0.05)) == 6
    # past the knee the step's time grows as its tokens do: a proposal with chance < 1 lowers the rate
    assert costs.best_extra(2, np.full(20, 0.9)) == 6
    assert costs.best_extra(2, np.zeros(0)) == 0
    roomy = StepCosts(32)
    for n in range(1, 33):  # a GPU's shape: flat to 24 tokens
        roomy.record(n, 0.01 * max(1.0, n / 24))
    assert roomy.best_extra(2, np.full(20, 0.05)) == 20


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 8), chances=st.lists(st.floats(0.0, 1.0), max_size=20),
       times=st.lists(st.floats(1e-3, 1.0), min_size=24, max_size=24))
def test_the_choice_maximises_tokens_per_second(rows, chances, times):
    costs = StepCosts(24)
    for n, t in enumerate(times, start=1):
        costs.record(n, t)
    g = np.sort(np.array(chances))[::-1]
    k = costs.best_extra(rows, g)
    est = costs.estimates()
    rate = [(rows + g[:j].sum()) / est[rows + j] for j in range(min(g.size, 24 - rows) + 1)]
    # NOTE: the reference sums the chances pairwise, best_extra by a running sum: the same rate up to
    # rounding, so compare in ulps of the rate (an absolute 1e-12 was below one ulp at ~5000 tokens/s)
    assert rate[k] >= max(rate) * (1 - 8 * np.finfo(float).eps)
