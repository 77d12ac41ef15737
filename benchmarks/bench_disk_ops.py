"""disk backend: per-operation cost of small objects (where fixed overheads show).

64 KiB objects, buffered I/O in the page cache, ``fsync: false``: what is left is the
backend's own work per operation (path resolution, index transactions, verification),
which is what the sandbox and the index checks could add to. Measured in one process:

* ``put``: one ``put`` of a new key;
* ``get_into``: one hit into a caller buffer;
* ``contains128``: ``batched_contains`` of 128 keys, half of them stored;
* ``batched_put16`` / ``batched_get_into16``: one call with 16 chunks.

Each figure is the median over blocks of operations, blocks interleaved between the
metrics. ``--compare SRC`` runs this script alternately in processes importing the disk
backend from ``SRC`` (another checkout's ``src`` directory, e.g. the code before a change)
and from the installed one, ``--rounds`` times each, and prints per metric the ratio of
the medians (this / other) beside the A/A spread (the same code in different rounds).

Run: .venv/bin/python benchmarks/bench_disk_ops.py [--compare DIR] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

import torch

VALUE = 64 * 1024
OPS = 64  # operations per block
BLOCKS = 12


def measure() -> dict[str, float]:
    """Median microseconds per operation of each metric (this process's code)."""
    from lmcache_backend_disk import DiskBackend

    from lmcache_core import CacheEngineKey, Namespace

    ns = Namespace(model_name="bench-ops")
    val = torch.randint(0, 255, (VALUE,), dtype=torch.uint8)
    out = torch.empty(VALUE, dtype=torch.uint8)
    outs = [torch.empty(VALUE, dtype=torch.uint8) for _ in range(16)]
    counter = iter(range(10**9))

    def key(i: int) -> CacheEngineKey:
        return CacheEngineKey("bench-ops", 1, 0, i + 1, "uint8")

    async def body(root: str) -> dict[str, float]:
        b = DiskBackend(
            {"path": root, "max_bytes": "8GiB", "direct_io": "false", "fsync": False},
            namespace=ns,
        )
        await b.start()
        stored = [key(next(counter)) for _ in range(256)]
        assert all(await b.batched_put(stored, [val] * len(stored)))
        absent = [key(10**8 + i) for i in range(64)]
        probe = [k for pair in zip(stored[:64], absent, strict=True) for k in pair]

        async def put() -> None:
            assert await b.put(key(next(counter)), val)

        async def get_into() -> None:
            assert await b.get_into(stored[next(counter) % len(stored)], out)

        async def contains() -> None:
            await b.batched_contains(probe)

        async def bput() -> None:
            ks = [key(next(counter)) for _ in range(16)]
            assert all(await b.batched_put(ks, [val] * 16))

        async def bget() -> None:
            i = next(counter) % (len(stored) - 16)
            assert all(await b.batched_get_into(stored[i : i + 16], outs))

        metrics: dict[str, Callable[[], Awaitable[None]]] = {
            "put": put,
            "get_into": get_into,
            "contains128": contains,
            "batched_put16": bput,
            "batched_get_into16": bget,
        }
        samples: dict[str, list[float]] = {m: [] for m in metrics}
        try:
            for fn in metrics.values():  # warm-up
                for _ in range(8):
                    await fn()
            for _ in range(BLOCKS):
                for name, fn in metrics.items():
                    t0 = time.perf_counter()
                    for _ in range(OPS):
                        await fn()
                    samples[name].append((time.perf_counter() - t0) / OPS * 1e6)
        finally:
            await b.close()
        return {m: statistics.median(s) for m, s in samples.items()}

    with tempfile.TemporaryDirectory(prefix="bench-disk-ops-") as root:
        return asyncio.run(body(os.path.join(root, "tier")))


def _run(src: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, __file__, "--one"], capture_output=True, text=True, env=env, check=True
    )
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def compare(src: str, rounds: int) -> None:
    this: list[dict[str, float]] = []
    other: list[dict[str, float]] = []
    for r in range(rounds):  # alternate, and alternate who goes first
        pair = [(this, None), (other, src)]
        for runs, path in pair if r % 2 == 0 else pair[::-1]:
            runs.append(_run(path))
    print(f"per-operation medians over {rounds} alternating rounds, {VALUE // 1024} KiB objects")
    print(f"{'metric':<20} {'this us':>9} {'other us':>9} {'this/other':>11} {'A/A spread':>12}")
    for m in this[0]:
        a = statistics.median(r[m] for r in this)
        b = statistics.median(r[m] for r in other)
        spread = [r[m] / a for r in this] + [r[m] / b for r in other]
        print(f"{m:<20} {a:9.1f} {b:9.1f} {a / b:10.2f}x "
              f"{min(spread):5.2f}-{max(spread):4.2f}x")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", metavar="SRC", help="the other code's src directory")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure()))
    elif args.compare:
        compare(args.compare, args.rounds)
    else:
        for m, us in measure().items():
            print(f"{m:<20} {us:9.1f} us")


if __name__ == "__main__":
    main()
