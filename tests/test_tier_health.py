"""TierHealth: the backoff after consecutive tier errors stays finite and capped."""

from __future__ import annotations

import math

import pytest

from lmcache_core.hierarchy.health import TierHealth


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_then_caps() -> None:
    h = TierHealth(0.5, 30.0, clock=Clock())
    assert [h.backoff_s(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert h.backoff_s(7) == 30.0 and h.backoff_s(0) == 0.0


@pytest.mark.parametrize("initial", [0.0, 0.5, 1e-300, 1e300])
def test_a_long_outage_never_overflows(initial: float) -> None:
    """Issue 10: ``initial * 2**(n-1)`` raised OverflowError after ~1,024 errors."""
    clock = Clock()
    h = TierHealth(initial, 30.0, clock=clock)
    for _ in range(2000):
        h.failed(RuntimeError("down"))
    assert h.consecutive_errors == 2000
    assert math.isfinite(h.retry_at) and h.retry_at <= clock.now + max(30.0, initial)
    assert 0.0 <= h.backoff_s(10**9) <= max(30.0, initial)
    assert h.as_dict()["state"] in ("backoff", "retrying")
    clock.now += max(30.0, initial) + 1
    assert h.usable()
    h.succeeded()
    assert h.state == "ok" and h.recoveries == 1


def test_settings_must_be_finite() -> None:
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError):
            TierHealth(bad, 30.0)
        with pytest.raises(ValueError):
            TierHealth(0.5, bad)
