"""Priority inversion through the GIL: a niced thread that runs Python stalls the loop.

An asyncio heartbeat (1 ms sleeps) runs beside a background thread at a given niceness
that alternates GIL-free work (a ctypes ``memmove`` of ``--mib`` MiB, as the I/O and
staging threads do) with a little Python. ``--burners`` busy-loop processes load the
machine from outside. Prints the heartbeat's p50 / p99 / max lag per niceness.

    .venv/bin/python benchmarks/bench_nice_gil.py --burners 2 --nice 0 10 19

With outside load, a nice-19 (or nice-10) thread that takes the GIL is descheduled for
long stretches while the loop waits for it (CPython's forced GIL hand-off waits until the
requesting thread has actually taken the GIL), so the loop's worst lags grow with the
niceness; at nice 0 they stay at the scheduler's normal latency.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import statistics
import threading
import time

from bench_loop_stall import burners  # (no lmcache code: its imports are lazy)


def worker(nice: int, mib: int, stop: threading.Event) -> None:
    if nice:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    n = mib << 20
    src = ctypes.create_string_buffer(n)
    dst = ctypes.create_string_buffer(n)
    while not stop.is_set():
        ctypes.memmove(dst, src, n)  # GIL released
        x = 0
        for i in range(200):  # a little Python, as every I/O job has
            x += i


async def heartbeat(seconds: float) -> list[float]:
    lags: list[float] = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - t0 - 0.001)
    return lags


def measure(nice: int, mib: int, seconds: float) -> list[float]:
    stop = threading.Event()
    t = threading.Thread(target=worker, args=(nice, mib, stop), daemon=True)
    t.start()
    try:
        return asyncio.run(heartbeat(seconds))
    finally:
        stop.set()
        t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--burners", type=int, default=2, help="busy-loop processes (default 2)")
    ap.add_argument("--nice", type=int, nargs="+", default=[0, 10, 19])
    ap.add_argument("--mib", type=int, default=1, help="MiB per GIL-free copy (default 1)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the nicenesses")
    args = ap.parse_args()
    with burners(args.burners):
        for r in range(args.rounds):
            for nice in args.nice:
                lags = sorted(measure(nice, args.mib, args.seconds))
                p99 = lags[int(0.99 * (len(lags) - 1))]
                print(
                    f"round {r} nice {nice:2d}: beats {len(lags):5d}  p50 "
                    f"{statistics.median(lags) * 1e3:6.2f} ms  p99 {p99 * 1e3:7.2f} ms  "
                    f"max {lags[-1] * 1e3:7.1f} ms",
                    flush=True,
                )


if __name__ == "__main__":
    main()
