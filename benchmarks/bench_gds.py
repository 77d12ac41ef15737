"""gds backend on its POSIX O_DIRECT path vs raw O_DIRECT pwrite/preadv of the same bytes.

This machine has no CUDA driver, so the ``gds`` tier runs its fallback: the disk tier's
object I/O with ``O_DIRECT`` from and into page-aligned host memory. For each chunk size
(``--sizes``, MiB), ``--total-mib`` of data per contender and repeat:

* raw put (twice per repeat, ``raw_a`` and ``raw_b``: the A/A pair): the same number of
  files, each created, written with one ``O_DIRECT`` ``os.pwrite`` of header + data from a
  reused aligned buffer, fsynced and renamed, ``--inflight`` requests in flight;
* gds put: ``batched_put`` of batches of ``--batch`` chunks, all batches submitted at once
  (``io_threads`` operations in flight); every object is checksummed, reserved in the
  shared index, fdatasync'ed, renamed, recorded and its directory fsynced;
* raw cold get (twice): every file read with one ``O_DIRECT`` ``os.preadv`` into reused
  aligned buffers, ``--inflight`` in flight;
* gds cold get: ``batched_get_into`` into ``aligned_empty`` buffers, every read verified
  (size, header, identity, checksum); ``--plain`` adds reads into plain ``torch.empty``
  buffers (staged: one more copy).

The page cache is dropped before every cold read (``echo 3 > /proc/sys/vm/drop_caches``,
else ``POSIX_FADV_DONTNEED`` per file). Contenders rotate order between repeats; the
figures are medians over repeats, ratios are medians of per-repeat pairs (raw time / gds
time), and the A/A line (raw_a vs raw_b) shows how far two identical runs drift apart.

Run: .venv/bin/python benchmarks/bench_gds.py [--dir DIR] [--sizes 4,32] [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_disk import HEADER, _ThreadBuffers, baseline_get, baseline_put, drop_caches
from lmcache_backend_disk import aligned_empty
from lmcache_backend_gds import GdsBackend

from lmcache_core import CacheEngineKey, Namespace

MiB = 1 << 20


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


async def _put(b: GdsBackend, keys: list[CacheEngineKey], vals: list[torch.Tensor], batch: int):  # type: ignore[no-untyped-def]
    groups = [(keys[i : i + batch], vals[i : i + batch]) for i in range(0, len(keys), batch)]
    res = await asyncio.gather(*(b.batched_put(k, v) for k, v in groups))
    assert all(all(r) for r in res), "a put was refused"


async def _get(b: GdsBackend, keys: list[CacheEngineKey], outs: list[torch.Tensor], batch: int):  # type: ignore[no-untyped-def]
    groups = [(keys[i : i + batch], outs[i : i + batch]) for i in range(0, len(keys), batch)]
    res = await asyncio.gather(*(b.batched_get_into(k, o) for k, o in groups))
    assert all(all(r) for r in res), "a get missed"


async def _remove_all(b: GdsBackend, keys: list[CacheEngineKey]) -> None:
    await asyncio.gather(*(b.remove(k) for k in keys))


class _Size:
    """One chunk size: one long-lived backend (warm threads and buffers) across repeats."""

    def __init__(self, args: argparse.Namespace, mib: int) -> None:
        self.args = args
        self.nbytes = mib * MiB
        self.n = max(16, args.total_mib // mib)
        self.values = [aligned_empty((self.nbytes,), torch.uint8).fill_(i % 251)
                       for i in range(self.n)]  # fmt: skip
        self.outs = [aligned_empty((self.nbytes,), torch.uint8).fill_(0) for _ in range(self.n)]
        self.plain = (
            [torch.zeros(self.nbytes, dtype=torch.uint8) for _ in range(self.n)]
            if args.plain
            else []
        )
        self.pool = concurrent.futures.ThreadPoolExecutor(args.inflight)
        self.bufs = _ThreadBuffers(self.nbytes + HEADER)
        names = ["put_raw_a", "put_gds", "put_raw_b", "get_raw_a", "get_gds", "get_raw_b"]
        if args.plain:
            names.append("get_gds_plain")
        self.samples: dict[str, list[float]] = {k: [] for k in names}
        self.work = tempfile.mkdtemp(prefix="bench-gds-", dir=args.dir)
        self.backend = GdsBackend(
            {
                "path": os.path.join(self.work, "tier"),
                "max_bytes": 4 * self.n * (self.nbytes + HEADER),
                "io_threads": args.io_threads,
                "io_nice": args.io_nice,
            },
            namespace=Namespace(model_name="bench-gds"),
        )
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.backend.start())
        st = self.backend.stats()
        self.io_path = f"{st['io_path']} ({st['io_path_reason']})"
        if not st["direct_io"]:
            raise SystemExit(f"{self.work} refuses O_DIRECT: not the path this measures")
        self.cold_by = ""

    def close(self) -> None:
        self.loop.run_until_complete(self.backend.close())
        self.loop.close()
        self.pool.shutdown()
        shutil.rmtree(self.work, ignore_errors=True)

    def repeat(self, r: int) -> None:
        a, b, loop, n = self.args, self.backend, self.loop, self.n
        keys = [CacheEngineKey("bench-gds", 1, 0, (r << 32) + i + 1, "uint8") for i in range(n)]
        raw = {x: os.path.join(self.work, f"raw_{x}") for x in "ab"}
        puts: list[tuple[str, Callable[[], Any]]] = [
            ("put_raw_a", lambda: baseline_put(raw["a"], n, self.nbytes, self.pool, self.bufs)),
            ("put_gds", lambda: loop.run_until_complete(_put(b, keys, self.values, a.batch))),
            ("put_raw_b", lambda: baseline_put(raw["b"], n, self.nbytes, self.pool, self.bufs)),
        ]
        gets: list[tuple[str, Callable[[], Any]]] = [
            ("get_raw_a", lambda: baseline_get(raw["a"], n, self.nbytes, self.pool, self.bufs)),
            ("get_gds", lambda: loop.run_until_complete(_get(b, keys, self.outs, a.batch))),
            ("get_raw_b", lambda: baseline_get(raw["b"], n, self.nbytes, self.pool, self.bufs)),
        ]
        if a.plain:
            gets.append(
                (
                    "get_gds_plain",
                    lambda: loop.run_until_complete(_get(b, keys, self.plain, a.batch)),
                )
            )
        puts = puts[r % len(puts) :] + puts[: r % len(puts)]
        gets = gets[r % len(gets) :] + gets[: r % len(gets)]
        for name, fn in puts:
            os.sync()
            self.samples[name].append(_timed(fn))
        for name, fn in gets:
            self.cold_by = drop_caches([self.work])
            self.samples[name].append(_timed(fn))
        for i in (0, n - 1):  # what was read back is what was written
            assert torch.equal(self.outs[i], self.values[i])
            if a.plain:
                assert torch.equal(self.plain[i], self.values[i])
        loop.run_until_complete(_remove_all(b, keys))
        for d in raw.values():
            shutil.rmtree(d, ignore_errors=True)

    def report(self) -> dict[str, float]:
        s, total = self.samples, self.n * self.nbytes
        gbs = {k: total / statistics.median(v) / 1e9 for k, v in s.items()}

        def paired(num: str, den: str) -> list[float]:
            return [x / y for x, y in zip(s[num], s[den], strict=True)]

        out: dict[str, float] = {}
        print(
            f"\n{self.nbytes // MiB} MiB chunks x {self.n}, {len(s['put_gds'])} repeats, "
            f"io path: {self.io_path}, cold reads by {self.cold_by}, raw {self.args.inflight} "
            f"in flight, gds io_threads={self.backend.opts.io_threads} io_nice="
            f"{self.backend.opts.io_nice} batch={self.args.batch}"
        )
        for op in ("put", "get"):
            # raw time / gds time, against each raw run of the same repeat (mean of the two)
            ratios = [
                (x + y) / 2
                for x, y in zip(
                    paired(f"{op}_raw_a", f"{op}_gds"), paired(f"{op}_raw_b", f"{op}_gds"),
                    strict=True,
                )
            ]  # fmt: skip
            aa = paired(f"{op}_raw_a", f"{op}_raw_b")
            ratio, aa_med = statistics.median(ratios), statistics.median(aa)
            what = "write" if op == "put" else "cold read"
            print(
                f"  {what:9s} raw {gbs[f'{op}_raw_a']:5.2f} / {gbs[f'{op}_raw_b']:5.2f} GB/s | "
                f"gds {gbs[f'{op}_gds']:5.2f} GB/s = {ratio:.2f}x raw (repeats "
                f"{min(ratios):.2f}-{max(ratios):.2f}) | A/A raw_a/raw_b {aa_med:.2f}x "
                f"(repeats {min(aa):.2f}-{max(aa):.2f})"
            )
            out[f"{op}_ratio"] = ratio
            out[f"{op}_aa"] = aa_med
        if self.args.plain:
            pl = [
                (x + y) / 2
                for x, y in zip(
                    paired("get_raw_a", "get_gds_plain"), paired("get_raw_b", "get_gds_plain"),
                    strict=True,
                )
            ]  # fmt: skip
            print(
                f"  cold read into plain torch.empty buffers: {gbs['get_gds_plain']:5.2f} GB/s "
                f"= {statistics.median(pl):.2f}x raw"
            )
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    p.add_argument("--sizes", default="4,32", help="chunk sizes in MiB, comma-separated")
    p.add_argument("--total-mib", type=int, default=512, help="data per contender and repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inflight", type=int, default=16, help="raw requests in flight")
    p.add_argument("--io-threads", type=int, default=32, help="the gds tier's io_threads")
    p.add_argument("--batch", type=int, default=16, help="chunks per batched call")
    p.add_argument("--io-nice", type=int, default=0,
                   help="the tier's io_nice (default 0: the baseline threads' priority)")  # fmt: skip
    p.add_argument("--plain", action="store_true", help="also read into plain buffers")
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless writes >= 0.8x and cold reads >= 0.9x")  # fmt: skip
    args = p.parse_args(argv)
    failed = False
    for mib in [int(x) for x in args.sizes.split(",") if x]:
        size = _Size(args, mib)
        try:
            for r in range(args.repeats):
                size.repeat(r)
        finally:
            size.close()
        res = size.report()
        failed |= res["put_ratio"] < 0.8 or res["get_ratio"] < 0.9
    if args.check and failed:
        print("below target: writes >= 0.8x, cold reads >= 0.9x", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
