"""The benchmarks' paired timer and the median of paired ratios with its interval, against
orders and order statistics worked out by hand."""
import math
import sys

import numpy as np
import pytest

from train_util import ROOT

sys.path.insert(0, str(ROOT / "experiments"))
import bench_timing  # noqa: E402


def test_paired_times_alternate_the_two_programs_and_pair_their_calls():
    calls = []
    # A clock that advances 1 per reading, and calls that advance it by 10 (first) or 20
    # (second): every timed call then lasts exactly 1 + its own cost.
    clock_time = [0.0]

    def clock():
        clock_time[0] += 1.0
        return clock_time[0]

    def first():
        calls.append("a")
        clock_time[0] += 10

    def second():
        calls.append("b")
        clock_time[0] += 20

    a, b = bench_timing.paired_times(first, second, 4, clock=clock)
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up, then ABBA
    np.testing.assert_array_equal(a, [11.0] * 4)
    np.testing.assert_array_equal(b, [21.0] * 4)


def test_a_drift_of_the_machine_cancels_in_the_paired_ratios():
    """Calls of equal cost on a machine that slows by 1% a call: the best-of timing of one
    program after the other sees the drift as a difference; the alternated pairs do not."""
    slowdown = [1.0]
    clock_time = [0.0]

    def clock():
        return clock_time[0]

    def call():
        clock_time[0] += slowdown[0]
        slowdown[0] *= 1.01

    a, b = bench_timing.paired_times(call, call, 50, warmup=False, clock=clock)
    summary = bench_timing.median_ratio(a, b)
    assert summary["median"] == pytest.approx(1.0, abs=0.011)
    assert summary["ci"][0] <= 1.0 <= summary["ci"][1]
    # One program's 50 calls, then the other's: a 64% apparent difference.
    first = [1.01 ** i for i in range(50)]
    later = [1.01 ** (50 + i) for i in range(50)]
    assert np.median(later) / np.median(first) == pytest.approx(1.01 ** 50)


def test_median_ratio_interval_is_the_binomial_order_statistics():
    # n = 10: P(Bin(10, 1/2) <= 1) = 11/1024 <= 0.025 < P(<= 2) = 56/1024, so j = 2: the
    # 2nd and 9th smallest ratios.
    numerator = np.array([1.30, 1.02, 0.97, 1.10, 1.01, 0.99, 1.05, 1.20, 1.03, 0.90])
    out = bench_timing.median_ratio(numerator, np.ones(10))
    assert out["n"] == 10 and out["median"] == pytest.approx((1.02 + 1.03) / 2)
    assert out["ci"] == pytest.approx([0.97, 1.20])
    assert sum(math.comb(10, k) for k in range(2)) / 1024 <= 0.025
    assert sum(math.comb(10, k) for k in range(3)) / 1024 > 0.025
    # Five pairs cannot give a 95% interval (P(Bin(5, 1/2) = 0) = 1/32 > 0.025).
    assert bench_timing.median_ratio(np.ones(5), np.ones(5))["ci"] is None


def test_ratio_line_says_what_the_interval_resolves():
    line = lambda lo, hi: bench_timing.ratio_line(
        {"n": 100, "median": (lo + hi) / 2, "ci": [lo, hi]}, "step", claim=0.03)
    assert line(0.99, 1.02).endswith("within the claim (<= 1.03)")
    assert "above the claim (> 1.03): the overhead is real" in line(1.05, 1.09)
    narrow = line(1.01, 1.05)
    assert "not resolved" in narrow and "wider than the claim" not in narrow
    wide = line(0.95, 1.10)
    assert "not resolved" in wide and "half-width 0.075 is wider than the claim 0.030" in wide
    assert line(0.99, 1.02).startswith(
        "step: median ratio 1.005, 95% interval [0.990, 1.020] over 100 pairs")
