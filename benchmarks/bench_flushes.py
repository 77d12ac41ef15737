"""The flushes that end a batch of durable puts: two waves from Python threads, one wave
from Python threads, one wave from the compiled helper, against the raw loop's.

A batch of ``--files`` objects of ``--mib`` MiB, each in its own directory (the disk
tier's shards: a batch of fresh keys touches about one shard directory per object), is
written with ``O_DIRECT`` untimed; then only the flushes that make it durable are timed:

* ``raw``: the raw baseline's end (``benchmarks/_storage.raw_write``): ``fsync`` of every
  file, 16 in flight, then one ``fsync`` of the one directory holding all of them;
* ``two waves``: the disk tier before this benchmark: ``fdatasync`` of every file (16
  Python threads), the renames, then ``fsync`` of every directory (16 Python threads);
* ``one wave, python``: the renames, then every file's ``fdatasync`` and every
  directory's ``fsync`` in one wave of 16 Python threads (``LMCACHE_CORE_FLUSHES=python``);
* ``one wave, compiled``: the same wave issued at once by
  :func:`lmcache_core.flushes.sync_fds` (what the tier does now), measured twice under two
  names for the A/A spread.

Medians of ``--repeats`` interleaved repetitions (the order rotates), with the device's
cache flushes per batch (``/proc/diskstats``) where the kernel reports them.

    flock /tmp/lmcache-heavy.lock .venv/bin/python benchmarks/bench_flushes.py
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _storage import aligned_bytes, disk_counters

from lmcache_core import flushes

MiB = 1 << 20
O_DIRECT = getattr(os, "O_DIRECT", 0)
IN_FLIGHT = 16  # the raw loop's deepest setting, and the tier's Python flusher's


def device_flushes(path: str) -> int | None:
    """Cache flushes the block device holding ``path`` has completed (``None``: unknown)."""
    counters = disk_counters(path)
    return counters[15] if counters is not None and len(counters) > 15 else None


class Batch:
    """One written, not yet flushed batch: its files open, its names temporary."""

    def __init__(self, top: str, n: int, src: list[memoryview], one_dir: bool) -> None:
        self.top = top
        os.makedirs(top)
        self.dirs = [top] if one_dir else [os.path.join(top, f"s{i:03d}") for i in range(n)]
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
        os.sync()  # the directories exist before the batch, as a tier's shards do
        self.paths = [os.path.join(self.dirs[0 if one_dir else i], f"o{i}") for i in range(n)]
        self.fds = []
        for p, buf in zip(self.paths, src, strict=True):
            fd = os.open(p + ".tmp", os.O_WRONLY | os.O_CREAT | O_DIRECT, 0o600)
            os.posix_fallocate(fd, 0, len(buf))
            self.fds.append(fd)
        with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
            list(pool.map(lambda i: os.pwritev(self.fds[i], [src[i]], 0), range(n)))

    def rename_all(self) -> None:
        for p in self.paths:
            os.rename(p + ".tmp", p)

    @contextmanager
    def opened_dirs(self) -> Iterator[list[int]]:
        """Descriptors of the batch's directories, closed at the end."""
        fds = [os.open(d, os.O_RDONLY | os.O_DIRECTORY) for d in self.dirs]
        try:
            yield fds
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        shutil.rmtree(self.top)


def _threads(fn: Callable[[int], object], fds: list[int]) -> None:
    with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
        list(pool.map(fn, fds))


def raw(b: Batch) -> None:
    _threads(os.fsync, b.fds)
    with b.opened_dirs() as (d,):
        os.fsync(d)


def two_waves(b: Batch) -> None:
    _threads(os.fdatasync, b.fds)
    b.rename_all()
    with b.opened_dirs() as dirs:
        _threads(os.fsync, dirs)


def one_wave_python(b: Batch) -> None:
    b.rename_all()
    n = len(b.fds)
    with b.opened_dirs() as dirs:
        fds = b.fds + dirs
        _threads(lambda i: (os.fdatasync if i < n else os.fsync)(fds[i]), [*range(len(fds))])


def one_wave_compiled(b: Batch) -> None:
    b.rename_all()
    with b.opened_dirs() as dirs:
        errors = flushes.sync_fds(b.fds + dirs, [True] * len(b.fds) + [False] * len(dirs))
    if errors is None:
        raise RuntimeError("lmcache_core's compiled module is not built here")
    for e in errors:
        if e is not None:
            raise e


CONTENDERS: dict[str, tuple[Callable[[Batch], None], bool]] = {
    "raw": (raw, True),
    "two waves": (two_waves, False),
    "one wave, python": (one_wave_python, False),
    "one wave, compiled": (one_wave_compiled, False),
    "one wave, compiled (A/A)": (one_wave_compiled, False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=32, help="objects per batch (32)")
    ap.add_argument("--mib", type=int, default=4, help="MiB per object (4)")
    ap.add_argument("--repeats", type=int, default=9, help="repetitions per contender (9)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    if not flushes.native():
        sys.exit(
            "lmcache_core's compiled module is not built here (or LMCACHE_CORE_FLUSHES=python)"
        )
    src = [aligned_bytes(args.mib * MiB) for _ in range(args.files)]
    for i, buf in enumerate(src):
        buf[:] = bytes([i % 251]) * len(buf)
    work = tempfile.mkdtemp(prefix="bench-flushes-", dir=args.dir)
    names = list(CONTENDERS)
    times: dict[str, list[float]] = {n: [] for n in names}
    dev_flushes: dict[str, list[int]] = {n: [] for n in names}
    print(
        f"{args.files} objects of {args.mib} MiB per batch, {args.repeats} repetitions, "
        f"in {work}; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    try:
        for r in range(args.repeats):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                fn, one_dir = CONTENDERS[name]
                b = Batch(os.path.join(work, f"r{r}-{names.index(name)}"), args.files, src, one_dir)
                try:
                    f0 = device_flushes(work)
                    t0 = time.perf_counter()
                    fn(b)
                    times[name].append(time.perf_counter() - t0)
                    f1 = device_flushes(work)
                    if f0 is not None and f1 is not None:
                        dev_flushes[name].append(f1 - f0)
                finally:
                    b.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {n: statistics.median(v) for n, v in times.items()}
    aa = max(med["one wave, compiled"], med["one wave, compiled (A/A)"]) / min(
        med["one wave, compiled"], med["one wave, compiled (A/A)"]
    )
    print(
        "| flushes of one batch | median ms | device flushes (median) | raw / this | two waves / this |"
    )
    print("|---|---|---|---|---|")
    for n in names:
        fl = f"{statistics.median(dev_flushes[n]):.0f}" if dev_flushes[n] else "n/a"
        print(
            f"| {n} | {med[n] * 1e3:.2f} | {fl} | {med['raw'] / med[n]:.2f}x | "
            f"{med['two waves'] / med[n]:.2f}x |"
        )
    print(f"A/A spread (the compiled wave against itself): {aa:.2f}")


if __name__ == "__main__":
    main()
