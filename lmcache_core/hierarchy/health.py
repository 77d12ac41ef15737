"""Failure isolation state of one tier: healthy, or skipped until a retry time."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["TierHealth"]

#: 2**64 times any sane initial backoff exceeds any sane cap; beyond it only min() matters.
_MAX_DOUBLINGS = 64


class TierHealth:
    """Exponential backoff after errors.

    After an error the tier is skipped for ``backoff`` seconds (``initial_s``, doubling
    per consecutive error up to ``max_s``). Once that time has passed, calls are let
    through again; the first success resets the backoff, another error extends it.
    """

    def __init__(
        self, initial_s: float, max_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        for name, value in (("initial_s", initial_s), ("max_s", max_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.initial_s = float(initial_s)
        self.max_s = float(max(max_s, initial_s))
        self._clock = clock
        self.consecutive_errors = 0
        self.retry_at = 0.0
        self.last_error: str | None = None
        self.recoveries = 0

    def usable(self) -> bool:
        """Whether calls may go to the tier now."""
        return self.consecutive_errors == 0 or self._clock() >= self.retry_at

    def failed(self, exc: BaseException) -> None:
        """Record an error and push the next retry out."""
        self.consecutive_errors += 1
        self.retry_at = self._clock() + self.backoff_s(self.consecutive_errors)
        self.last_error = f"{type(exc).__name__}: {exc}"

    def backoff_s(self, errors: int) -> float:
        """Seconds the tier is skipped after ``errors`` consecutive errors.

        ``initial_s * 2**(errors-1)`` capped at ``max_s``. The exponent is capped before
        the power is taken, so any number of errors (a tier down for days) gives a finite
        number: never an ``OverflowError``.
        """
        if errors <= 0:
            return 0.0
        return min(self.max_s, self.initial_s * 2.0 ** min(errors - 1, _MAX_DOUBLINGS))

    def succeeded(self) -> None:
        """Record a success: the tier is healthy again."""
        if self.consecutive_errors:
            self.recoveries += 1
            self.consecutive_errors = 0

    @property
    def state(self) -> str:
        """``ok``, ``backoff`` (skipped until ``retry_at``) or ``retrying`` (next call decides)."""
        if self.consecutive_errors == 0:
            return "ok"
        return "retrying" if self._clock() >= self.retry_at else "backoff"

    def as_dict(self) -> dict[str, object]:
        d: dict[str, object] = {
            "state": self.state,
            "consecutive_errors": self.consecutive_errors,
            "recoveries": self.recoveries,
            "last_error": self.last_error,
        }
        if self.consecutive_errors:
            d["retry_in_s"] = round(max(0.0, self.retry_at - self._clock()), 3)
        return d
