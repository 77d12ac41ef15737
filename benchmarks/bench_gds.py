"""gds backend on its POSIX O_DIRECT path vs raw O_DIRECT pwritev/preadv of the same bytes.

This machine has no CUDA driver, so the ``gds`` tier runs its fallback: the disk tier's
object I/O with ``O_DIRECT`` from and into page-aligned host memory (or through staging
slots for plain buffers). The measurement is bench_disk's, with the gds tier in place of
the disk tier: for each chunk size (``--sizes``, MiB), ``--total-mib`` of data per
contender and repeat,

* raw put (the baseline): as many files of the objects' size, from ordinary page-aligned
  memory, preallocated, ``O_DIRECT`` ``pwritev`` requests of at most 4 MiB with 1, 4 and
  16 requests in flight (``--inflight``; the best median is the baseline, the last count
  is measured twice for the A/A spread), fsynced, renamed, directory fsynced;
* gds put: ``batched_put`` of batches of ``--batch`` chunks (all submitted at once), from
  plain and from aligned values; every object checksummed, reserved in the shared index,
  fdatasync'ed, renamed, recorded and its directory fsynced;
* cold reads: the files read are dropped from the page cache and checked with
  ``mincore`` first; raw ``preadv`` (same in-flight counts) against ``batched_get_into``
  into aligned and into plain ``torch.empty`` buffers, every read verified.

Ratios are raw time / gds time (> 1: gds is faster). Targets (issue 17): writes >= 0.8x,
cold reads >= 0.9x the raw baseline.

Run: .venv/bin/python benchmarks/bench_gds.py [--dir DIR] [--sizes 4,32] [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lmcache_backend_gds import GdsBackend

from lmcache_core import Namespace
from lmcache_core.backend import BaseBackend

sys.path.insert(0, str(Path(__file__).parent))
from _storage import QDS
from bench_disk import _Size


class _GdsSize(_Size):
    """bench_disk's chunk-size round with the gds tier (one long-lived backend)."""

    def open_backend(self, opts: dict[str, Any]) -> BaseBackend:
        opts["io_threads"] = self.args.io_threads
        return GdsBackend(opts, namespace=Namespace(model_name="bench-gds"))

    def describe(self) -> str:
        st = self.backend.stats()
        return (
            f"gds io path {st['io_path']} ({st['io_path_reason']}), "
            f"io_threads={self.args.io_threads}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    p.add_argument("--sizes", default="4,32", help="chunk sizes in MiB, comma-separated")
    p.add_argument("--total-mib", type=int, default=512, help="data per contender and repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inflight", default=",".join(map(str, QDS)),
                   help="raw baseline requests in flight, each measured; the best is the "
                   "baseline, the last is measured twice for the A/A spread")  # fmt: skip
    p.add_argument("--io-threads", type=int, default=32, help="the gds tier's io_threads")
    p.add_argument("--batch", type=int, default=16, help="chunks per batched call")
    p.add_argument("--io-nice", type=int, default=0,
                   help="the tier's io_nice (default 0: the baseline threads' priority)")  # fmt: skip
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless writes >= 0.8x and cold reads >= 0.9x")  # fmt: skip
    args = p.parse_args(argv)
    args.disk_concurrency = 0
    args.reads_in_flight = 0  # bench_disk only (gds stripes keep the disk default)
    args.steady = False  # bench_disk only (the disk tier's directories)
    failed = False
    for mib in [int(x) for x in args.sizes.split(",") if x]:
        size = _GdsSize(args, mib)
        try:
            for r in range(args.repeats):
                size.repeat(r)
        finally:
            size.close()
        res = size.report()
        failed |= min(res["ratio put disk"], res["ratio put aligned"]) < 0.8
        failed |= min(res["ratio get aligned"], res["ratio get plain"]) < 0.9
    if args.check and failed:
        print("below target: writes >= 0.8x, cold reads >= 0.9x", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
