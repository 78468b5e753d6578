"""`python -m benchmarks.query_outer`: the paired rounds, the median's interval and the verdict
against the default's gate (CPU; the command itself needs a GPU)."""

import math
import os
import random

import pytest

from benchmarks import query_outer, trained_selection
from benchmarks.msa import with_query_outer_setting
from benchmarks.problems import ProblemSpec
from torch_msa.settings import QUERY_OUTER_ENV


def _coverage(n: int, rank: int) -> float:
    """P(the `rank`-th smallest of n values <= the median <= the `rank`-th largest), exactly."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(rank)) / 2**n


@pytest.mark.parametrize("n", [6, 7, 10, 20, 30, 31, 60, 200])
def test_the_medians_interval_is_the_narrowest_of_order_statistics_that_covers_it_95_percent(n):
    values = [float(i) for i in range(n)]
    random.Random(n).shuffle(values)
    low, high = query_outer.median_interval(values)
    rank = int(low) + 1
    assert high == n - rank  # symmetric: the rank-th smallest and the rank-th largest
    assert _coverage(n, rank) >= 0.95 > _coverage(n, rank + 1)
    if n == 30:
        assert (low, high) == (9.0, 20.0)  # the textbook ranks 10 and 21 of 30


def test_below_six_values_the_interval_is_the_range():
    assert query_outer.median_interval([5.0, 1.0, 3.0]) == (1.0, 5.0)
    assert query_outer.median_interval([2.0]) == (2.0, 2.0)
    with pytest.raises(ValueError, match="values: expected at least one value, got none"):
        query_outer.median_interval([])


@pytest.mark.parametrize(("interval", "expected"), [
    ((0.90, 1.02), "within"), ((0.97, 1.01), "within"), ((1.0201, 1.05), "slower"), ((1.01, 1.03), "undecided"),
    ((0.95, 1.10), "undecided"),
])
def test_the_verdict_reads_where_the_interval_lies_against_the_gate(interval, expected):
    assert query_outer.verdict(interval, gate=0.02) == expected


def test_pairs_alternate_which_setting_runs_first_and_pair_each_round():
    order = []
    clock = iter(range(1, 100))

    def timer(name):
        def timed():
            order.append(name)
            return float(next(clock))
        return timed

    paired = query_outer.in_pairs(timer("kv"), timer("q"), 4)
    assert order == ["kv", "q", "q", "kv", "kv", "q", "q", "kv"]
    assert paired.kv_outer_ms == (1.0, 4.0, 5.0, 8.0) and paired.query_outer_ms == (2.0, 3.0, 6.0, 7.0)
    assert paired.ratios == (2.0, 0.75, 6 / 5, 7 / 8)
    summary = paired.summary()
    assert summary["kv_outer_ms"] == 4.5 and summary["query_outer_ms"] == 4.5
    assert summary["ratio"] == pytest.approx((0.875 + 1.2) / 2) and summary["interval"] == (0.75, 2.0)
    assert summary["verdict"] == "undecided"


def test_each_setting_runs_with_its_flag_and_the_callers_value_comes_back(monkeypatch):
    monkeypatch.setenv(QUERY_OUTER_ENV, "yes")
    seen = with_query_outer_setting(lambda: os.environ[QUERY_OUTER_ENV], "0")()
    assert seen == "0" and os.environ[QUERY_OUTER_ENV] == "yes"
    monkeypatch.delenv(QUERY_OUTER_ENV)
    assert with_query_outer_setting(lambda: os.environ[QUERY_OUTER_ENV], "1")() == "1"
    assert QUERY_OUTER_ENV not in os.environ


def test_a_document_longer_than_the_trained_ones_runs_as_a_pack_of_trained_length_under_trained():
    trained = min(trained_selection.load().lengths)
    longer = ProblemSpec((2 * trained + 5,))
    assert query_outer.problem_for(longer, "trained") == ProblemSpec((trained, trained, 5), pack=True)
    assert query_outer.problem_for(longer, "index") == longer
    assert query_outer.problem_for(ProblemSpec((trained,)), "trained") == ProblemSpec((trained,))


def test_a_row_refuses_an_unknown_mode_by_name():
    with pytest.raises(ValueError, match=r"mode: expected one of \('forward', 'autograd', 'step'\), got 'backward'"):
        query_outer.measure(ProblemSpec((1024,)), None, "index", None, 6, 0, mode="backward")
