"""disk backend: batched put and cold get_into against a raw O_DIRECT baseline (same run).

For 4 MiB and 32 MiB chunks (``--sizes``), ``--total-mib`` of data per contender:

* raw put (the baseline): the same number of files of the objects' size (4 KiB header +
  data), from ordinary page-aligned memory, each preallocated, written with ``O_DIRECT``
  ``pwritev`` requests of at most 4 MiB with 1, 4 and 16 requests in flight
  (``--inflight``; each measured, the best median is the baseline, the last count is
  measured twice for the A/A spread), fsynced, renamed into place, directory fsynced;
* backend put: ``batched_put`` of batches of ``--batch`` chunks, all batches submitted at
  once, from plain ``torch.empty`` values and from ``aligned_empty`` values; every object
  is checksummed, reserved in the shared index, fdatasync'ed, renamed, recorded and its
  directory fsynced;
* with ``--steady`` also ``put steady``: plain values as in ``put disk``, but the
  ``ab/cd`` directories of their keys exist before the put (made untimed beforehand), as
  in a tier that already holds many objects. The other puts write new keys into a young
  tier (each object's ``ab/cd`` directory is new: ``mkdir`` and a parent fsync more per
  object); ``put disk`` stays the figure the bars are measured with;
* before every cold read the files it reads are dropped from the page cache
  (``POSIX_FADV_DONTNEED``) and checked with ``mincore`` (none of their pages resident);
* raw get: ``O_DIRECT`` ``preadv`` requests of at most 4 MiB into aligned buffers, same
  in-flight counts;
* backend get: ``batched_get_into`` into 4 KiB-aligned tensors (``aligned_empty``: read
  straight into them) and into plain ``torch.empty`` tensors (64-byte aligned: read
  through staging slots, several pieces in flight per object). Every read is verified
  (size, header, identity, checksum) and compared with what was written.

Contenders rotate order between repeats; ratios are raw time / backend time (> 1: the
backend is faster): the ratio of medians, and the median of per-repeat pairs. ``--engines``
also measures aiofiles against the thread pool (the choice of the backend's I/O engine).

Run: .venv/bin/python benchmarks/bench_disk.py [--dir DIR] [--sizes 4,32] [--repeats 5]
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
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lmcache_backend_disk import DiskBackend, aligned_empty

sys.path.insert(0, str(Path(__file__).parent))
from _storage import (
    QDS,
    aligned_bytes,
    backend_get,
    backend_put,
    files_under,
    flush_wave_kind,
    make_cold,
    raw_read,
    raw_write,
    remove_all,
)
from _util import aa_spread

from lmcache_core import CacheEngineKey, Namespace
from lmcache_core.backend import BaseBackend

MiB = 1 << 20
HEADER = 4096  # the backend's objects carry a 4 KiB header; the baseline writes as much
O_DIRECT = getattr(os, "O_DIRECT", 0)


# --------------------------------------------------------------------------- helpers
def drop_caches(tops: list[str]) -> None:
    """Drop every file below these directories from the page cache, checked with
    ``mincore`` (raises if any page stays resident)."""
    make_cold([f for top in tops for f in files_under(top)])


def _timed(fn: Callable[[], Any], cpu: list[float] | None = None) -> float:
    """Wall time of ``fn()``; appends the process CPU time it used (all threads) to ``cpu``."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return wall


# --------------------------------------------------------------------------- one size
class _Size:
    """Everything one chunk size needs across repeats. One backend serves all repeats (as
    a long-lived tier would: warm threads and staging buffers); each repeat writes new
    objects and removes them afterwards, untimed."""

    def __init__(self, args: argparse.Namespace, mib: int) -> None:
        self.args = args
        self.nbytes = mib * MiB
        self.n = max(16, args.total_mib // mib)
        self.values = [torch.empty(self.nbytes, dtype=torch.uint8).fill_(i % 251)
                       for i in range(self.n)]  # fmt: skip
        self.values_aligned = [aligned_empty((self.nbytes,), torch.uint8).copy_(v)
                               for v in self.values]  # fmt: skip
        self.outs_aligned = [aligned_empty((self.nbytes,), torch.uint8) for _ in range(self.n)]
        self.outs_plain = [torch.empty(self.nbytes, dtype=torch.uint8) for _ in range(self.n)]
        for o in (*self.outs_aligned, *self.outs_plain):
            o.fill_(0)  # fault the pages in: reused caller buffers, as in steady state
        # the raw baseline moves as many bytes per file as an object has (header + data)
        self.raw_src = [aligned_bytes(self.nbytes + HEADER) for _ in range(self.n)]
        for buf, v in zip(self.raw_src, self.values, strict=True):
            buf[HEADER:] = v.numpy().tobytes()
        self.raw_dst = [aligned_bytes(self.nbytes + HEADER) for _ in range(self.n)]
        #: raw variants: requests in flight; the last one is measured twice (its A/A pair)
        self.qds = [int(q) for q in args.inflight.split(",")]
        self.raw = [f"qd{q}" for q in self.qds] + [f"qd{self.qds[-1]} again"]
        names = [f"put raw {v}" for v in self.raw] + ["put disk", "put aligned"]
        names += ["put steady"] if args.steady else []
        names += [f"get raw {v}" for v in self.raw] + ["get aligned", "get plain"]
        self.samples: dict[str, list[float]] = {k: [] for k in names}
        self.cpu: dict[str, list[float]] = {k: [] for k in names}
        self.work = tempfile.mkdtemp(prefix="bench-disk-", dir=args.dir)
        self.tier_dir = os.path.join(self.work, "tier")
        self.backend = self.open_backend(
            {
                "path": self.tier_dir,
                "max_bytes": 4 * self.n * (self.nbytes + HEADER),
                "io_nice": args.io_nice,
            }
        )
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.backend.start())
        if not self.backend.stats().get("direct_io"):
            raise SystemExit(f"{self.work} refuses O_DIRECT: not the path this measures")

    def open_backend(self, opts: dict[str, Any]) -> BaseBackend:
        """The tier measured (the disk tier; bench_gds measures its own)."""
        if self.args.disk_concurrency:
            opts["concurrency"] = self.args.disk_concurrency
        if self.args.reads_in_flight:
            opts["reads_in_flight"] = self.args.reads_in_flight
        return DiskBackend(opts, namespace=Namespace(model_name="bench-disk"))

    def make_dirs(self, keys: list[CacheEngineKey]) -> None:
        """Create (untimed) the directories ``keys``' objects go into, as a tier that
        already holds many objects has them (``--steady``)."""
        b = self.backend
        assert isinstance(b, DiskBackend), "--steady measures the disk tier"
        for k in keys:
            os.makedirs(os.path.join(b.root, b._rel(k).rpartition("/")[0]), 0o700, True)
        os.sync()

    def describe(self) -> str:
        """The tier's settings, for the report."""
        b = self.backend
        assert isinstance(b, DiskBackend)
        rif = getattr(b.opts, "reads_in_flight", "unlimited")  # (older versions: unlimited)
        turns = getattr(getattr(b, "_io", None), "_read_turns", None)
        queue = getattr(turns, "native", None)  # (older versions: a semaphore)
        kind = "compiled" if queue else "python semaphore" if queue is False else "none"
        return (
            f"disk concurrency={b.opts.concurrency}, reads in flight={rif}, read queue={kind}, "
            f"flushes={flush_wave_kind()}"
        )

    def close(self) -> None:
        self.loop.run_until_complete(self.backend.close())
        self.loop.close()
        shutil.rmtree(self.work, ignore_errors=True)

    def _qd(self, variant: str) -> int:
        return int(variant.split()[0][2:])

    def repeat(self, r: int) -> None:
        """One round: every put, then every cold read (orders rotate between rounds)."""
        args, b, loop = self.args, self.backend, self.loop
        keys = [
            CacheEngineKey("bench-disk", 1, 0, (r << 32) + i + 1, "uint8") for i in range(self.n)
        ]
        keys2 = [CacheEngineKey("bench-disk", 1, 0, (r << 32) + (1 << 31) + i, "uint8")
                 for i in range(self.n)]  # fmt: skip
        keys3 = [CacheEngineKey("bench-disk", 1, 0, (r << 32) + (3 << 30) + i, "uint8")
                 for i in range(self.n)]  # fmt: skip
        names = [f"f{i}" for i in range(self.n)]
        raw_paths: dict[str, list[str]] = {}

        def put_raw(v: str) -> None:
            d = os.path.join(self.work, f"raw-{v.replace(' ', '-')}")
            raw_paths[v] = raw_write(d, names, self.raw_src, self._qd(v), publish=True)

        steps: list[tuple[str, Callable[[], Any]]] = [
            (f"put raw {v}", partial(put_raw, v)) for v in self.raw
        ]
        steps += [
            ("put disk", lambda: loop.run_until_complete(
                backend_put(b, keys, self.values, args.batch))),
            ("put aligned", lambda: loop.run_until_complete(
                backend_put(b, keys2, self.values_aligned, args.batch))),
        ]  # fmt: skip
        if args.steady:
            self.make_dirs(keys3)
            steps.append(("put steady", lambda: loop.run_until_complete(
                backend_put(b, keys3, self.values, args.batch))))  # fmt: skip

        def raw_read_of(v: str) -> Any:
            return raw_read(raw_paths[v], self.raw_dst, self._qd(v))

        gets: list[tuple[str, Callable[[], Any], Callable[[], list[str]]]] = [
            (
                f"get raw {v}",
                partial(raw_read_of, v),
                partial(raw_paths.__getitem__, v),
            )
            for v in self.raw
        ]
        objects = lambda: files_under(self.tier_dir, self.nbytes)  # noqa: E731
        gets += [
            ("get aligned", lambda: loop.run_until_complete(
                backend_get(b, keys, self.outs_aligned, args.batch)), objects),
            ("get plain", lambda: loop.run_until_complete(
                backend_get(b, keys, self.outs_plain, args.batch)), objects),
        ]  # fmt: skip
        k = r % len(steps)
        for name, fn in steps[k:] + steps[:k]:
            os.sync()
            self.samples[name].append(_timed(fn, self.cpu[name]))
        k = r % len(gets)
        for name, fn, files in gets[k:] + gets[:k]:
            make_cold(files())
            self.samples[name].append(_timed(fn, self.cpu[name]))
        for i in (0, self.n - 1):  # what was read back is what was written
            assert torch.equal(self.outs_plain[i], self.values[i])
            assert torch.equal(self.outs_aligned[i], self.values[i])
            assert bytes(self.raw_dst[i]) == bytes(self.raw_src[i])
            self.outs_plain[i].fill_(0)
            self.outs_aligned[i].fill_(0)
        loop.run_until_complete(remove_all(b, keys + keys2 + (keys3 if args.steady else [])))
        for v in self.raw:
            shutil.rmtree(os.path.join(self.work, f"raw-{v.replace(' ', '-')}"), True)

    def report(self) -> dict[str, float]:
        total = self.n * self.nbytes
        s = self.samples
        med = {k: statistics.median(v) for k, v in s.items()}
        g = {k: total / t / 1e9 for k, t in med.items()}
        print(f"\n{self.nbytes // MiB} MiB chunks x {self.n}, {self.args.repeats} repeats, "
              f"cold reads by fadvise + mincore check, batch={self.args.batch}, "
              f"io_nice={self.args.io_nice}, {self.describe()}, "
              f"raw baseline: best of {self.qds} in flight (4 MiB requests)")  # fmt: skip
        out: dict[str, float] = {}
        for op, ours in (
            ("put", ("put disk", "put aligned", *(["put steady"] if self.args.steady else []))),
            ("get", ("get aligned", "get plain")),
        ):
            best = min(self.raw[:-1], key=lambda v: med[f"{op} raw {v}"])
            base = f"{op} raw {best}"
            last = self.raw[-2]
            aa = aa_spread(s[f"{op} raw {last}"], s[f"{op} raw {self.raw[-1]}"])
            raws = ", ".join(f"{v} {g[f'{op} raw {v}']:.2f}" for v in self.raw)
            print(f"  {op}  raw GB/s: {raws} | best {best} | A/A {last} twice {aa:.2f}")
            for name in ours:
                pairs = [x / y for x, y in zip(s[base], s[name], strict=True)]
                ratio = med[base] / med[name]
                print(f"    {name:12s} {g[name]:5.2f} GB/s = {ratio:.2f}x raw (paired "
                      f"{statistics.median(pairs):.2f}x, repeats {min(pairs):.2f}-"
                      f"{max(pairs):.2f})")  # fmt: skip
                out[f"ratio {name}"] = ratio
            out[f"aa {op}"] = aa
        gib = total / 2**30
        cpu = {k: statistics.median(v) / gib for k, v in self.cpu.items()}
        print("  CPU seconds per GiB (all threads): " + ", ".join(
            f"{k} {v:.2f}" for k, v in cpu.items()))  # fmt: skip
        return out


def bench_size(args: argparse.Namespace, mib: int) -> dict[str, float]:
    """Measure one chunk size ``repeats`` times; print medians and ratios."""
    size = _Size(args, mib)
    try:
        for r in range(args.repeats):
            size.repeat(r)
    finally:
        size.close()
    return size.report()


# --------------------------------------------------------------------------- engines
def _engine_round(args: argparse.Namespace, nbytes: int, n: int, r: int,
                  rounds: dict[str, list[float]]) -> None:  # fmt: skip
    """One round of put + cold get with each engine (order alternates)."""
    import aiofiles
    import aiofiles.os

    data = os.urandom(nbytes)
    work = tempfile.mkdtemp(prefix="bench-engines-", dir=args.dir)
    pool = concurrent.futures.ThreadPoolExecutor(args.concurrency)
    loop = asyncio.new_event_loop()
    loop.set_default_executor(pool)  # aiofiles runs in the loop's default executor
    sem = asyncio.Semaphore(args.concurrency)
    fsync = aiofiles.os.wrap(os.fsync)

    def put_sync(path: str) -> None:  # one pool job per operation
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(path + ".tmp", path)

    def get_sync(path: str) -> None:
        buf = bytearray(nbytes)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.readv(fd, [buf])
        finally:
            os.close(fd)

    async def put_aio(path: str) -> None:  # aiofiles: one executor hop per call
        async with sem:
            async with aiofiles.open(path + ".tmp", "wb") as f:
                await f.write(data)
                await f.flush()
                await fsync(f.fileno())
            await aiofiles.os.rename(path + ".tmp", path)

    async def get_aio(path: str) -> None:
        async with sem:
            buf = bytearray(nbytes)
            async with aiofiles.open(path, "rb", buffering=0) as f:
                await f.readinto(buf)

    async def many(fn: Callable[[str], Any], tag: str, aio: bool) -> None:
        paths = [os.path.join(work, f"{tag}{i}") for i in range(n)]
        if aio:
            await asyncio.gather(*(fn(p) for p in paths))
        else:
            await asyncio.gather(*(loop.run_in_executor(pool, fn, p) for p in paths))

    engines = [("threads", put_sync, get_sync, False), ("aiofiles", put_aio, get_aio, True)]
    if r % 2:
        engines.reverse()
    try:
        for name, put_fn, _, aio in engines:
            t0 = time.perf_counter()
            loop.run_until_complete(many(put_fn, name, aio))
            rounds[f"{name} put"].append(time.perf_counter() - t0)
        drop_caches([work])
        for name, _, get_fn, aio in engines:
            t0 = time.perf_counter()
            loop.run_until_complete(many(get_fn, name, aio))
            rounds[f"{name} get"].append(time.perf_counter() - t0)
    finally:
        loop.close()
        pool.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def bench_engines(args: argparse.Namespace) -> None:
    """aiofiles against one thread-pool job per operation; buffered I/O, 16 in flight."""
    for nbytes, n in ((4 * MiB, 128), (64 * 1024, 2000)):
        rounds: dict[str, list[float]] = {
            k: [] for k in ("threads put", "aiofiles put", "threads get", "aiofiles get")
        }
        for r in range(args.repeats):
            _engine_round(args, nbytes, n, r, rounds)
        med = {k: statistics.median(v) for k, v in rounds.items()}
        size = f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB"
        print(f"\nI/O engine: {n} x {size}, buffered, {args.concurrency} in flight, "
              f"median of {args.repeats}")  # fmt: skip
        for op in ("put", "get"):
            t, a = med[f"threads {op}"], med[f"aiofiles {op}"]
            print(f"  {op}  thread pool {n / t:7.0f} ops/s | aiofiles {n / a:7.0f} ops/s | "
                  f"thread pool = {a / t:.2f}x aiofiles")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    ap.add_argument("--sizes", default="4,32", help="chunk sizes in MiB (default 4,32)")
    ap.add_argument("--total-mib", type=int, default=1024, help="data per run (default 1024)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="chunks per batched call")
    ap.add_argument("--inflight", default=",".join(map(str, QDS)),
                    help="raw baseline requests in flight, each measured; the best is the "
                    "baseline, the last is measured twice for the A/A spread")  # fmt: skip
    ap.add_argument("--concurrency", type=int, default=16,
                    help="requests in flight of --engines")  # fmt: skip
    ap.add_argument(
        "--disk-concurrency",
        type=int,
        default=0,
        help="the backend's concurrency (default: its own)",
    )
    ap.add_argument(
        "--reads-in-flight",
        type=int,
        default=0,
        help="the disk backend's reads_in_flight (default: its own)",
    )
    ap.add_argument(
        "--steady",
        action="store_true",
        help="also 'put steady': plain values into directories that exist already",
    )
    ap.add_argument("--engines", action="store_true", help="also compare aiofiles / threads")
    ap.add_argument(
        "--io-nice",
        type=int,
        default=0,
        help="the backend's io_nice (default 0: same priority as the baseline's threads)",
    )
    args = ap.parse_args()
    for mib in (int(s) for s in args.sizes.split(",") if s):
        bench_size(args, mib)
    if args.engines:
        bench_engines(args)


if __name__ == "__main__":
    main()
