"""disk backend: batched put and cold get_into against a raw O_DIRECT baseline (same run).

For 4 MiB and 32 MiB chunks (``--sizes``), ``--total-mib`` of data per run:

* baseline put: the same number of files, each created, written from a reused aligned
  buffer with ``O_DIRECT`` (16 requests in flight), fsynced and renamed;
* backend put: ``batched_put`` of batches of ``--batch`` chunks, all batches submitted at
  once (the backend's pool keeps ``concurrency`` = 16 operations in flight); every object
  is checksummed, reserved in the shared index, fdatasync'ed, renamed, recorded and its
  directory fsynced;
* page cache dropped (``echo 3 > /proc/sys/vm/drop_caches``; ``POSIX_FADV_DONTNEED`` per
  file when that is not permitted);
* baseline get: every file read cold with ``O_DIRECT`` into reused aligned buffers (16 in
  flight);
* backend get: ``batched_get_into`` into caller buffers, cold, once into 4 KiB-aligned
  tensors (``aligned_empty``: read straight into them) and once into plain ``torch.empty``
  tensors (64-byte aligned: read into a staging buffer, then copied). Every read is
  verified (size, header, identity, checksum).

Contenders alternate order between repeats; medians are printed with ratios to the
baseline. ``--engines`` also measures aiofiles against the thread pool (the choice of the
backend's I/O engine).

Run: .venv/bin/python benchmarks/bench_disk.py [--dir DIR] [--sizes 4,32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from lmcache_backend_disk import DiskBackend, aligned_empty

from lmcache_core import CacheEngineKey, Namespace

MiB = 1 << 20
HEADER = 4096  # the backend's objects carry a 4 KiB header; the baseline writes as much
O_DIRECT = getattr(os, "O_DIRECT", 0)


# --------------------------------------------------------------------------- helpers
def drop_caches(paths: list[str]) -> str:
    """Drop the page cache (all of it when permitted, else these files')."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for top in paths:
            for dirpath, _dirs, files in os.walk(top):
                for name in files:
                    try:
                        fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                    except OSError:
                        continue
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
        return "fadvise"


class _ThreadBuffers:
    """One reused page-aligned buffer per thread."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._local = threading.local()
        self._all: list[mmap.mmap] = []

    def get(self) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            m = mmap.mmap(-1, self.nbytes)
            m.write(os.urandom(min(self.nbytes, 1 << 16)) * (self.nbytes // (1 << 16) or 1))
            self._all.append(m)
            buf = self._local.buf = memoryview(m)
        return buf


def _timed(fn: Callable[[], Any], cpu: list[float] | None = None) -> float:
    """Wall time of ``fn()``; appends the process CPU time it used (all threads) to ``cpu``."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return wall


# --------------------------------------------------------------------------- baseline
def baseline_put(
    directory: str, n: int, nbytes: int, pool: concurrent.futures.Executor, bufs: _ThreadBuffers
) -> None:
    os.makedirs(directory, exist_ok=True)

    def one(i: int) -> None:
        buf = bufs.get()
        tmp, final = os.path.join(directory, f".f{i}.tmp"), os.path.join(directory, f"f{i}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600)
        try:
            os.pwrite(fd, buf[: nbytes + HEADER], 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)

    list(pool.map(one, range(n)))


def baseline_get(
    directory: str, n: int, nbytes: int, pool: concurrent.futures.Executor, bufs: _ThreadBuffers
) -> None:
    def one(i: int) -> None:
        buf = bufs.get()
        fd = os.open(os.path.join(directory, f"f{i}"), os.O_RDONLY | O_DIRECT)
        try:
            got = os.preadv(fd, [buf[: nbytes + HEADER]], 0)
        finally:
            os.close(fd)
        assert got == nbytes + HEADER

    list(pool.map(one, range(n)))


# --------------------------------------------------------------------------- backend
async def backend_put(
    b: DiskBackend, keys: list[CacheEngineKey], values: list[torch.Tensor], batch: int
) -> None:
    groups = [(keys[i : i + batch], values[i : i + batch]) for i in range(0, len(keys), batch)]
    results = await asyncio.gather(*(b.batched_put(k, v) for k, v in groups))
    assert all(all(r) for r in results), "a put was refused"


async def backend_get(
    b: DiskBackend, keys: list[CacheEngineKey], outs: list[torch.Tensor], batch: int
) -> None:
    groups = [(keys[i : i + batch], outs[i : i + batch]) for i in range(0, len(keys), batch)]
    results = await asyncio.gather(*(b.batched_get_into(k, o) for k, o in groups))
    assert all(all(r) for r in results), "a get missed"


async def _remove_all(b: DiskBackend, keys: list[CacheEngineKey]) -> None:
    await asyncio.gather(*(b.remove(k) for k in keys))


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
        self.pool = concurrent.futures.ThreadPoolExecutor(args.concurrency)
        self.bufs = _ThreadBuffers(self.nbytes + HEADER)
        self.samples: dict[str, list[float]] = {
            k: []
            for k in ("put_base", "put_disk", "put_aligned", "get_base", "get_aligned", "get_plain")
        }
        self.cpu: dict[str, list[float]] = {k: [] for k in self.samples}
        self.cold_by = ""
        self.work = tempfile.mkdtemp(prefix="bench-disk-", dir=args.dir)
        self.base_dir = os.path.join(self.work, "raw")
        opts: dict[str, Any] = {"path": os.path.join(self.work, "tier"),
                                "max_bytes": 4 * self.n * (self.nbytes + HEADER),
                                "io_nice": args.io_nice}  # fmt: skip
        if args.disk_concurrency:
            opts["concurrency"] = args.disk_concurrency
        self.backend = DiskBackend(opts, namespace=Namespace(model_name="bench-disk"))
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.backend.start())
        if not self.backend.direct_io and not args.allow_buffered:
            raise SystemExit(f"{self.work} refuses O_DIRECT (--allow-buffered to run anyway)")

    def close(self) -> None:
        self.loop.run_until_complete(self.backend.close())
        self.loop.close()
        self.pool.shutdown()
        shutil.rmtree(self.work, ignore_errors=True)

    def repeat(self, r: int) -> None:
        """One round: three puts, then three cold reads (orders rotate between rounds)."""
        args, b, loop = self.args, self.backend, self.loop
        keys = [
            CacheEngineKey("bench-disk", 1, 0, (r << 32) + i + 1, "uint8") for i in range(self.n)
        ]
        keys2 = [CacheEngineKey("bench-disk", 1, 0, (r << 32) + (1 << 31) + i, "uint8")
                 for i in range(self.n)]  # fmt: skip
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("put_base", lambda: baseline_put(self.base_dir, self.n, self.nbytes, self.pool,
                                              self.bufs)),
            ("put_disk", lambda: loop.run_until_complete(
                backend_put(b, keys, self.values, args.batch))),
            ("put_aligned", lambda: loop.run_until_complete(
                backend_put(b, keys2, self.values_aligned, args.batch))),
        ]  # fmt: skip
        gets: list[tuple[str, Callable[[], Any]]] = [
            ("get_base", lambda: baseline_get(self.base_dir, self.n, self.nbytes, self.pool,
                                              self.bufs)),
            ("get_aligned", lambda: loop.run_until_complete(
                backend_get(b, keys, self.outs_aligned, args.batch))),
            ("get_plain", lambda: loop.run_until_complete(
                backend_get(b, keys, self.outs_plain, args.batch))),
        ]  # fmt: skip
        steps = steps[r % 3 :] + steps[: r % 3]
        gets = gets[r % 3 :] + gets[: r % 3]
        for name, fn in steps:
            os.sync()
            self.samples[name].append(_timed(fn, self.cpu[name]))
        for name, fn in gets:
            self.cold_by = drop_caches([self.work])
            self.samples[name].append(_timed(fn, self.cpu[name]))
        for i in (0, self.n - 1):  # what was read back is what was written
            assert torch.equal(self.outs_plain[i], self.values[i])
            assert torch.equal(self.outs_aligned[i], self.values[i])
        loop.run_until_complete(_remove_all(b, keys + keys2))
        shutil.rmtree(self.base_dir, ignore_errors=True)

    def report(self) -> dict[str, float]:
        total = self.n * self.nbytes
        g = {k: total / statistics.median(v) / 1e9 for k, v in self.samples.items()}
        s = self.samples
        # ratios of the pairs measured back to back: robust to slow phases of the machine
        pr = {
            k: statistics.median(b / d for b, d in zip(s[base], s[k], strict=True))
            for k, base in (("put_disk", "put_base"), ("put_aligned", "put_base"),
                            ("get_aligned", "get_base"), ("get_plain", "get_base"))
        }  # fmt: skip
        print(f"\n{self.nbytes // MiB} MiB chunks x {self.n}, median of {self.args.repeats}, "
              f"cold reads by {self.cold_by}, direct_io={self.backend.direct_io}, "
              f"batch={self.args.batch}, io_nice={self.args.io_nice}, disk concurrency="
              f"{self.backend.opts.concurrency}, baseline {self.args.concurrency} in flight")  # fmt: skip
        print(f"  put  baseline {g['put_base']:5.2f} GB/s | disk, plain values "
              f"{g['put_disk']:5.2f} GB/s = {g['put_disk'] / g['put_base']:.2f}x (paired "
              f"{pr['put_disk']:.2f}x) | disk, aligned values {g['put_aligned']:5.2f} GB/s = "
              f"{g['put_aligned'] / g['put_base']:.2f}x (paired {pr['put_aligned']:.2f}x)")  # fmt: skip
        print(f"  get  baseline {g['get_base']:5.2f} GB/s | disk, aligned out "
              f"{g['get_aligned']:5.2f} GB/s = {g['get_aligned'] / g['get_base']:.2f}x "
              f"(paired {pr['get_aligned']:.2f}x) | disk, plain out {g['get_plain']:5.2f} GB/s "
              f"= {g['get_plain'] / g['get_base']:.2f}x (paired {pr['get_plain']:.2f}x)")  # fmt: skip
        gib = total / 2**30
        cpu = {k: statistics.median(v) / gib for k, v in self.cpu.items()}
        print("  CPU seconds per GiB (all threads): " + ", ".join(
            f"{k} {v:.2f}" for k, v in cpu.items()))  # fmt: skip
        return {**g, **{f"ratio_{k}": v for k, v in pr.items()}}


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
    ap.add_argument("--concurrency", type=int, default=16, help="baseline requests in flight")
    ap.add_argument(
        "--disk-concurrency",
        type=int,
        default=0,
        help="the backend's concurrency (default: its own)",
    )
    ap.add_argument("--engines", action="store_true", help="also compare aiofiles / threads")
    ap.add_argument("--allow-buffered", action="store_true")
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
