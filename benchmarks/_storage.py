"""Helpers shared by the storage benchmarks (bench_disk, bench_gds, bench_peer).

* the raw baseline: durable ``O_DIRECT`` ``pwritev`` and cold ``preadv`` of the same bytes
  from ordinary page-aligned process memory, ``qd`` requests in flight;
* cold reads: the files dropped from the page cache and checked with ``mincore``;
* batched puts, gets and removals through any backend (typed on the backend protocol).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import mmap
import os
import time
from collections.abc import Sequence

import torch

from lmcache_core.interface import StorageBackend
from lmcache_core.keys import CacheEngineKey

__all__ = [
    "QDS",
    "RAW_REQUEST",
    "aligned_bytes",
    "backend_get",
    "backend_put",
    "disk_counters",
    "files_under",
    "fsync_dir",
    "make_cold",
    "raw_read",
    "raw_write",
    "remove_all",
    "resident_pages",
]

MiB = 1 << 20
O_DIRECT = getattr(os, "O_DIRECT", 0)
#: The raw baseline is the best of these request counts in flight (per the issues' rule).
QDS = (1, 4, 16)
#: The raw baseline issues requests of at most this many bytes (a 32 MiB file is 8 requests).
RAW_REQUEST = 4 * MiB


# =========================================================================== page cache
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path: str) -> int:
    """How many of the file's pages are in the page cache (``mincore``)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(v & 1 for v in vec)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def make_cold(paths: Sequence[str], attempts: int = 5) -> None:
    """Drop ``paths`` from the page cache and check with ``mincore`` that none of their
    pages is resident; raises if the kernel keeps any (dirty pages are synced first)."""
    left: list[str] = list(paths)
    for _ in range(attempts):
        for p in left:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        left = [p for p in left if resident_pages(p)]
        if not left:
            return
        time.sleep(0.01)
    raise RuntimeError(f"{len(left)} files still in the page cache, e.g. {left[0]}")


def files_under(top: str, min_size: int = 0) -> list[str]:
    """Every regular file of at least ``min_size`` bytes below ``top`` (an object tier's
    objects, to make cold before a read)."""
    out = []
    for d, _, files in os.walk(top):
        for f in files:
            p = os.path.join(d, f)
            if os.path.isfile(p) and not os.path.islink(p) and os.path.getsize(p) >= min_size:
                out.append(p)
    return out


def fsync_dir(path: str) -> None:
    """fsync a directory (its new and renamed entries become durable)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# =========================================================================== raw baseline
def aligned_bytes(nbytes: int) -> memoryview:
    """A page-aligned buffer (``O_DIRECT`` needs aligned memory) of the same kind as the
    contenders' ``aligned`` buffers: ``aligned_empty`` (ordinary process memory), not an
    ``mmap(-1)`` (``MAP_SHARED`` anonymous, i.e. shmem pages, which read slower with
    ``O_DIRECT`` here and so made the baseline easy to beat)."""
    from lmcache_backend_disk import aligned_empty

    buf = aligned_empty((nbytes,), torch.uint8)
    buf.fill_(0)  # fault the pages in, like the contenders' reused buffers
    return memoryview(buf.numpy().data).cast("B")


def _segments(sizes: Sequence[int], request: int) -> list[tuple[int, int, int]]:
    """(file index, offset, length) of every request, file after file."""
    return [(i, off, min(request, size - off)) for i, size in enumerate(sizes)
            for off in range(0, size, request)]  # fmt: skip


def raw_write(
    directory: str,
    names: Sequence[str],
    bufs: Sequence[memoryview],
    qd: int,
    request: int = RAW_REQUEST,
    *,
    publish: bool = False,
) -> list[str]:
    """Durable ``O_DIRECT`` writes of ``bufs``: each file preallocated (``fallocate``: the
    requests of one file land out of order, which would otherwise fragment it), then
    ``pwritev`` requests of at most ``request`` bytes, ``qd`` in flight, then an fsync
    per file (``qd`` at a time), with ``publish`` a rename of each from a temporary name
    (as a tier publishes), and an fsync of the directory. Returns the final paths."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, n) for n in names]
    tmps = [os.path.join(directory, f".{n}.tmp") if publish else p
            for n, p in zip(names, paths, strict=True)]  # fmt: skip
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600) for p in tmps]
    try:
        for fd, buf in zip(fds, bufs, strict=True):
            os.posix_fallocate(fd, 0, len(buf))

        def one(seg: tuple[int, int, int]) -> None:
            i, off, n = seg
            if os.pwritev(fds[i], [bufs[i][off : off + n]], off) != n:
                raise OSError(f"short write to {tmps[i]}")

        with concurrent.futures.ThreadPoolExecutor(qd) as pool:
            list(pool.map(one, _segments([len(b) for b in bufs], request)))
            list(pool.map(os.fsync, fds))
    finally:
        for fd in fds:
            os.close(fd)
    if publish:
        for tmp, path in zip(tmps, paths, strict=True):
            os.rename(tmp, path)
    fsync_dir(directory)
    return paths


def raw_read(
    paths: Sequence[str], bufs: Sequence[memoryview], qd: int, request: int = RAW_REQUEST
) -> None:
    """``O_DIRECT`` reads into aligned buffers: ``preadv`` requests of at most ``request``
    bytes, ``qd`` in flight."""
    fds = [os.open(p, os.O_RDONLY | O_DIRECT) for p in paths]
    try:

        def one(seg: tuple[int, int, int]) -> None:
            i, off, n = seg
            if os.preadv(fds[i], [bufs[i][off : off + n]], off) != n:
                raise OSError(f"short read from {paths[i]}")

        with concurrent.futures.ThreadPoolExecutor(qd) as pool:
            list(pool.map(one, _segments([len(b) for b in bufs], request)))
    finally:
        for fd in fds:
            os.close(fd)


# =========================================================================== backends
async def backend_put(
    b: StorageBackend, keys: Sequence[CacheEngineKey], values: Sequence[torch.Tensor], batch: int
) -> None:
    """``batched_put`` of ``batch`` chunks at a time, every batch submitted at once."""
    groups = [(keys[i : i + batch], values[i : i + batch]) for i in range(0, len(keys), batch)]
    results = await asyncio.gather(*(b.batched_put(k, v) for k, v in groups))
    assert all(all(r) for r in results), "a put was refused"


async def backend_get(
    b: StorageBackend, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor], batch: int
) -> None:
    """``batched_get_into`` of ``batch`` chunks at a time, every batch submitted at once."""
    groups = [(keys[i : i + batch], outs[i : i + batch]) for i in range(0, len(keys), batch)]
    results = await asyncio.gather(*(b.batched_get_into(k, o) for k, o in groups))
    assert all(all(r) for r in results), "a get missed"


async def remove_all(b: StorageBackend, keys: Sequence[CacheEngineKey]) -> None:
    """Remove every key (untimed clean-up between repeats)."""
    await asyncio.gather(*(b.remove(k) for k in keys))


def disk_counters(path: str) -> list[int] | None:
    """The ``/proc/diskstats`` counters of the disk holding ``path`` (of the whole disk for
    a partition): ``[0]`` reads completed, ``[4]`` writes completed, ``[15]`` cache
    flushes completed where the kernel reports them; ``None`` where unknown."""
    from lmcache_backend_disk.aligned import disk_sysfs_node

    try:
        node = disk_sysfs_node(os.stat(path).st_dev)
        major, minor = (int(x) for x in (node / "dev").read_text().split(":"))
        with open("/proc/diskstats") as f:
            for line in f:
                parts = line.split()
                if int(parts[0]) == major and int(parts[1]) == minor:
                    return [int(x) for x in parts[3:]]
    except (OSError, ValueError):
        return None
    return None


def flush_wave_kind() -> str:
    """How the disk tier here issues the flushes that end a put (``LMCACHE_CORE_FLUSHES``):
    one wave after the renames, compiled or from Python threads, or (older versions) a
    wave of file flushes before the renames and one of directory fsyncs after them."""
    from lmcache_backend_disk.flusher import Flusher

    if not hasattr(Flusher, "sync_fds"):
        return "two waves, python threads"
    from lmcache_core import flushes

    return "one wave, " + ("compiled" if flushes.native() else "python threads")
