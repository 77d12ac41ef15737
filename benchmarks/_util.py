"""Small helpers shared by the benchmarks (timing with medians of repeated runs)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_time(fn: Callable[[], object], repeat: int = 30, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def interleaved(
    fns: dict[str, Callable[[], object]], repeat: int = 30, warmup: int = 3, block: int = 5
) -> dict[str, float]:
    """Median times of several functions, measured round-robin in blocks of ``block`` calls.

    Round-robin keeps slow phases of a noisy machine from favouring one contender; blocks
    keep each contender's caches warm as they would be in a loop of its own.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(max(1, repeat // block)):
        for name, fn in fns.items():
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}
