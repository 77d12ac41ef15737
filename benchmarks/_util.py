"""Small helpers shared by the benchmarks (timing with medians of repeated runs)."""

from __future__ import annotations

import os
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


def interleaved_samples(
    fns: dict[str, Callable[[], object]], rounds: int = 21, block: int = 5, warmup: int = 2
) -> dict[str, list[float]]:
    """All sample times (seconds) of several functions, measured round-robin: each round
    runs every function ``block`` times in turn. Register one contender twice under two
    names to get its A/A spread (:func:`aa_spread`)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    clock = time.perf_counter
    for _ in range(rounds):
        for name, fn in fns.items():
            out = samples[name]
            for _ in range(block):
                t0 = clock()
                fn()
                out.append(clock() - t0)
    return samples


def pct(samples: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``samples``; 50 is the median."""
    if not samples:
        raise ValueError("no samples")
    if q == 50:
        return statistics.median(samples)
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))]


def aa_spread(a: list[float], b: list[float]) -> float:
    """How far two measurements of the same thing differ: max/min of their medians (>= 1)."""
    ma, mb = statistics.median(a), statistics.median(b)
    return max(ma, mb) / min(ma, mb)


def drop_page_cache(root: str) -> int:
    """Evict the files under ``root`` from the page cache (only them: the machine is
    shared), after flushing them; returns how many files were evicted."""
    n = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n
