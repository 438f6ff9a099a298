"""pass@k (evals/passk.py) against a brute-force count over every k-subset of the samples."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from evals.passk import pass_at_k, pass_at_k_report


def brute_force(n: int, c: int, k: int) -> Fraction:
    """Share of the k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(i < c for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_brute_force_enumeration(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_force(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_fraction_correct() -> None:
    for n, c in [(1, 0), (1, 1), (10, 3), (200, 57)]:
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_edge_cases() -> None:
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 10) == 1.0
    assert pass_at_k(10, 6, 5) == 1.0  # only 4 wrong samples: every 5-subset holds a correct one
    with pytest.raises(ValueError, match="at least 10 samples"):
        pass_at_k(5, 1, 10)
    with pytest.raises(ValueError, match="k >= 1"):
        pass_at_k(5, 1, 0)
    with pytest.raises(ValueError, match="correct count"):
        pass_at_k(5, 6, 1)


def test_large_n_is_stable_where_binomials_overflow_floats() -> None:
    n, c, k = 5000, 3, 200
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    with pytest.raises(OverflowError):
        float(math.comb(n, k)) / 1.0  # the naive ratio of floats cannot even be formed
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_report_means_per_item_values_in_item_order() -> None:
    ids, correct = ["a", "b", "c"], [0, 2, 5]
    rep = pass_at_k_report(ids, correct, 5, [2, 1])
    assert rep["problems"] == 3 and rep["samples"] == 5 and rep["k"] == [1, 2]
    assert rep["per_item"]["ids"] == ids and rep["per_item"]["correct"] == correct
    want1 = [float(brute_force(5, c, 1)) for c in correct]
    want2 = [float(brute_force(5, c, 2)) for c in correct]
    assert rep["per_item"]["pass@1"] == pytest.approx(want1)
    assert rep["per_item"]["pass@2"] == pytest.approx(want2)
    assert rep["pass@1"] == pytest.approx(sum(want1) / 3)
    assert rep["pass@2"] == pytest.approx(sum(want2) / 3)


def test_report_per_item_sample_counts_and_bad_input() -> None:
    rep = pass_at_k_report(["a", "b"], [1, 1], [2, 4], [1])
    assert rep["pass@1"] == pytest.approx((1 / 2 + 1 / 4) / 2) and rep["samples"] == 2
    with pytest.raises(ValueError, match="2 item ids but 1 correct"):
        pass_at_k_report(["a", "b"], [1], 4, [1])
    with pytest.raises(ValueError, match="empty suite"):
        pass_at_k_report([], [], 4, [1])
    with pytest.raises(ValueError, match="at least 8 samples"):
        pass_at_k_report(["a"], [1], 4, [1, 8])
