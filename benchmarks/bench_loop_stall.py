"""Event-loop stalls under 16 concurrent 4 MiB puts, the contract heartbeat's workload.

For each backend named, in a fresh process each (so thread priorities start fresh):
rounds of 16 concurrent puts of 4 MiB values for ``--seconds``, beside a 1 ms asyncio
heartbeat, and prints the heartbeat's p99 and worst lag, plain wall-clock and with the
contract test's discount for what other processes took
(:class:`lmcache_core.testing.contract._CpuWaits`), plus the niceness of the process's
``lmcache-*`` threads. ``--burners N`` starts N busy-loop processes for the whole run.

    .venv/bin/python benchmarks/bench_loop_stall.py --burners 2 --reps 3 wt cpu disk s3file

Backends: ``wt`` (two cpu tiers, write-through: the staging pool's spare thread), ``cpu``,
``disk`` (lmcache-backend-disk in a temporary directory), ``s3file`` (lmcache-backend-s3
over ``file://``: the byte-store base's I/O threads).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any


def burn() -> None:  # pragma: no cover - runs in a child process
    while True:
        pass


@contextlib.contextmanager
def burners(n: int) -> Iterator[None]:
    """``n`` busy-loop processes (outside CPU load) for the duration of the block."""
    procs = [multiprocessing.Process(target=burn, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join()


def make_backend(kind: str, tmp: str, nice: int | None) -> Any:
    from lmcache_core import TieredHierarchy

    extra = {} if nice is None else {"io_nice": nice}
    if kind == "wt":
        h = TieredHierarchy.from_config(
            {
                "tiers": [
                    {"name": "hot", "backend": "cpu", "options": {"max_bytes": "256MiB"}},
                    {"name": "warm", "backend": "cpu", "options": {"max_bytes": "512MiB"}},
                ]
            }
        )
        if nice is not None:
            h.pool.spare_nice = nice  # (read when its thread starts, at the first take)
        return h
    if kind == "cpu":
        from lmcache_core.backends.cpu import CPUBackend

        return CPUBackend({"max_bytes": "256MiB"})
    if kind == "disk":
        from lmcache_backend_disk import DiskBackend

        return DiskBackend({"path": f"{tmp}/tier", "max_bytes": "256MiB", **extra})
    if kind == "s3file":
        from lmcache_backend_s3 import S3Backend

        from lmcache_core.keys import Namespace

        ns = Namespace(model_name="stall", chunk_size=64)
        return S3Backend({"url": f"file://{tmp}/s3", **extra}, namespace=ns)
    raise SystemExit(f"unknown backend {kind!r}")


def thread_nices() -> dict[str, int]:
    out: dict[str, int] = {}
    for t in threading.enumerate():
        if t.native_id is None or not t.name.startswith("lmcache"):
            continue
        try:
            nice = os.getpriority(os.PRIO_PROCESS, t.native_id)
        except OSError:
            continue
        key = t.name.rsplit("_", 1)[0]
        out[key] = max(out.get(key, nice), nice)
    return out


async def one(kind: str, seconds: float, nice: int | None) -> dict[str, Any]:
    import torch

    import lmcache_core
    from lmcache_core.testing.contract import _CpuWaits, make_key, random_tensor

    with tempfile.TemporaryDirectory() as tmp:
        b = make_backend(kind, tmp, nice)
        await b.start()
        try:
            vals = [random_tensor((4 << 20,), torch.uint8, seed=i) for i in range(16)]
            keys = [make_key(f"hb{i}") for i in range(16)]
            raw: list[float] = []
            disc: list[float] = []
            stop = asyncio.Event()

            async def heartbeat() -> None:
                waits = _CpuWaits()
                try:
                    while not stop.is_set():
                        w0 = waits.snapshot()
                        t0 = time.perf_counter()
                        await asyncio.sleep(0.001)
                        lag = time.perf_counter() - t0 - 0.001
                        raw.append(lag)
                        disc.append(max(0.0, lag - waits.excused(w0, waits.snapshot())))
                finally:
                    waits.close()

            gc.collect()
            gc.disable()
            hb = asyncio.ensure_future(heartbeat())
            t_end = time.perf_counter() + seconds
            rounds = 0
            while time.perf_counter() < t_end:
                await asyncio.gather(*(b.put(k, v) for k, v in zip(keys, vals, strict=True)))
                rounds += 1
            stop.set()
            await hb
            gc.enable()
            nices = thread_nices()
        finally:
            await b.close()
    raw.sort()
    disc.sort()

    def p(xs: list[float], q: float) -> float:
        return round(xs[int(q * (len(xs) - 1))] * 1e3, 1)

    return {
        "kind": kind,
        "core": os.path.dirname(lmcache_core.__file__),
        "rounds": rounds,
        "beats": len(raw),
        "p99_ms": p(raw, 0.99),
        "max_ms": p(raw, 1.0),
        "disc_p99_ms": p(disc, 0.99),
        "disc_max_ms": p(disc, 1.0),
        "nices": nices,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kinds", nargs="+", help="wt, cpu, disk, s3file")
    ap.add_argument("--burners", type=int, default=0)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument(
        "--nice",
        default="",
        help="comma-separated io_nice / spare_nice values to run each backend at, in turn "
        "(default: the code's own default)",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    nices: list[int | None] = [int(x) for x in args.nice.split(",") if x] or [None]
    if args.child:
        print(json.dumps(asyncio.run(one(args.kinds[0], args.seconds, nices[0]))))
        return
    with burners(args.burners):
        for r in range(args.reps):
            for kind in args.kinds:
                for nice in nices:
                    cmd = [sys.executable, __file__, "--child", "--seconds", str(args.seconds)]
                    cmd += [] if nice is None else ["--nice", str(nice)]
                    out = subprocess.run([*cmd, kind], capture_output=True, text=True, check=False)
                    line = out.stdout.strip().splitlines()[-1:] or [out.stderr.strip()[-300:]]
                    print(
                        f"{time.strftime('%H:%M:%S', time.gmtime())} rep {r} {kind} "
                        f"nice {nice}: {line[0]}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
