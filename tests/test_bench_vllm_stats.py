"""The statistics of benchmarks/bench_vllm.py's miss bars (no engine): the verdict rule,
the per-round ratios of a toggle run, and the interval over engine processes."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_vllm as bv  # noqa: E402


def test_verdict_word() -> None:
    assert bv._verdict_word(1.00, 1.04, 0.99, 1.01, 1.05) == "met"
    assert bv._verdict_word(1.06, 1.10, 0.99, 1.01, 1.05) == "not met"
    assert bv._verdict_word(1.00, 1.06, 0.99, 1.01, 1.05) == "within noise"
    # a biased A/A voids any verdict, even a clear one
    assert bv._verdict_word(1.00, 1.02, 1.01, 1.03, 1.05).startswith("within noise (the A/A")


def test_toggle_ratios_against_the_geometric_mean_of_both_off_arms() -> None:
    rows = {
        "on": [{"first": 2.2}, {"first": 3.0}],
        "off": [{"first": 2.0}, {"first": 2.0}],
        "off2": [{"first": 2.0}, {"first": 4.5}],
    }
    base, ratios, aa = bv._toggle_ratios(rows)
    assert base == pytest.approx([2.0, 3.0])
    assert ratios == pytest.approx([1.1, 1.0])
    assert aa == pytest.approx([1.0, 2.25])


def test_t_quantiles_use_the_row_below_between_rows() -> None:
    assert bv._t975(1) == 12.706 and bv._t975(7) == 2.365
    assert bv._t975(22) == bv._t975(20) == 2.086  # fewer degrees of freedom: wider
    assert bv._t975(100) == 2.042 and bv._t975(0) == 12.706


def test_mean_interval_over_processes() -> None:
    xs = [1.029, 1.036, 1.041, 1.044, 1.046, 1.049, 1.056]
    m, lo, hi = bv._mean_ci_log(xs)
    logs = [math.log(x) for x in xs]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / (len(logs) - 1))
    half = 2.447 * sd / math.sqrt(len(xs))  # t(6)
    assert m == pytest.approx(math.exp(mean))
    assert (lo, hi) == pytest.approx((math.exp(mean - half), math.exp(mean + half)))
    assert lo < 1.043 < hi < 1.052
    # identical samples: a zero-width interval at the value
    assert bv._mean_ci_log([1.2, 1.2, 1.2]) == pytest.approx((1.2, 1.2, 1.2))
