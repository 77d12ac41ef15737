"""Reopening a big tier is fast: 100k entries of 4 KiB, page cache dropped, reopen and
find every entry within 10 s; no object is read at start (headers are checked lazily).

Only the reopen is measured: most entries are written by ``disk_testutil.bulk_fill`` (the
put path's exact bytes, checked against files it wrote) instead of 100k puts."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from disk_testutil import bulk_fill, object_bytes, run
from lmcache_backend_disk import DiskBackend
from lmcache_backend_disk.layout import (
    INDEX_FILE,
    META_DIR,
    namespace_dir,
    namespace_json,
    object_relpath,
)

from lmcache_core import CacheEngineKey, Namespace

N = 100_000
#: Entries stored through the put path; the others by :func:`disk_testutil.bulk_fill`.
REAL = 2_000
NS = Namespace(model_name="persist-100k")


def _value(i: int) -> torch.Tensor:
    return torch.full((4096,), i % 251, dtype=torch.uint8)


def _drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _storage_read_bytes() -> int:
    """Bytes this process made the kernel fetch from storage (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


@pytest.fixture
def scratch_fs(tmp_path: Path) -> Iterator[str]:
    """A fresh loop-mounted ext4 filesystem when mounting is permitted (cleanup is then one
    unmount instead of deleting 165k files and directories), else a temporary directory."""
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(3 << 30)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-N", "400000", str(image)],
                          capture_output=True).returncode == 0  # fmt: skip
    mounted = made and subprocess.run(["mount", "-o", "loop", str(image), str(mnt)],
                                      capture_output=True).returncode == 0  # fmt: skip
    try:
        yield str(mnt)
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)
        else:
            shutil.rmtree(mnt, ignore_errors=True)
        image.unlink()


@pytest.mark.slow
def test_100k_entries_reopen_cold_within_10_seconds(scratch_fs: str) -> None:
    root = os.path.join(scratch_fs, "tier")
    keys = [CacheEngineKey("persist-100k", 1, 0, i + 1, "uint8") for i in range(N)]

    async def fill() -> float:
        # fsync off only to keep the test short: durability is not what is measured here
        b = DiskBackend({"path": root, "max_bytes": "8GiB", "fsync": False}, namespace=NS)
        await b.start()
        t0 = time.perf_counter()
        try:
            # the first REAL entries through the put path (concurrent batches of 250)...
            groups = [(keys[j : j + 250], [_value(k) for k in range(j, j + 250)])
                      for j in range(0, REAL, 250)]  # fmt: skip
            results = await asyncio.gather(*(b.batched_put(k, v) for k, v in groups))
            assert all(all(r) for r in results)
            # ...the rest written directly (a put costs ~1 ms of Python on this machine;
            # how the tier was filled is not what is measured), byte for byte what the
            # put path wrote: checked here against its files, and by the reads below
            ns_json = namespace_json(NS)

            def obj(i: int) -> str:
                return os.path.join(root, object_relpath(namespace_dir(ns_json), keys[i]))

            for i in (0, 1, REAL - 1):
                with open(obj(i), "rb") as f:
                    data = _value(i).numpy().tobytes()
                    assert f.read() == object_bytes(keys[i], ns_json, data, torch.uint8, (4096,))
            bulk_fill(b, keys[REAL:], lambda i: _value(REAL + i).numpy().tobytes(),
                      torch.uint8, (4096,))  # fmt: skip
            put_st, put_dir = os.stat(obj(0)), os.stat(os.path.dirname(obj(0)))
            for i in (REAL, N - 1):  # same size and modes as the put path's files
                st = os.stat(obj(i))
                assert (st.st_mode, st.st_size) == (put_st.st_mode, put_st.st_size)
                assert os.stat(os.path.dirname(obj(i))).st_mode == put_dir.st_mode
            with b.index.snapshot() as tx:
                assert tx.totals() == (N * put_st.st_size, N)
        finally:
            await b.close()
        return time.perf_counter() - t0

    async def reopen() -> tuple[float, float, int, int]:
        before = _storage_read_bytes()
        t0 = time.perf_counter()
        b = DiskBackend({"path": root, "max_bytes": "8GiB"}, namespace=NS)
        await b.start()
        t_start = time.perf_counter() - t0
        read_at_start = _storage_read_bytes() - before
        try:
            found = 0
            for i in range(0, N, 5000):
                found += sum(await b.batched_contains(keys[i : i + 5000]))
            t_all = time.perf_counter() - t0
            assert b.stats()["entries"] == N
            for i in random.Random(3).sample(range(N), 300):
                got = await b.get(keys[i])
                assert got is not None and torch.equal(got, _value(i))
            assert b.stats()["bad_objects"] == 0
        finally:
            await b.close()
        return t_start, t_all, found, read_at_start

    t_fill = run(fill(), timeout=900)
    cold = _drop_caches()
    t_start, t_all, found, read_at_start = run(reopen(), timeout=300)
    print(f"\n100k x 4 KiB: filled in {t_fill:.1f} s; reopen ({'cold' if cold else 'warm'}) "
          f"start {t_start:.2f} s, every entry found after {t_all:.2f} s; "
          f"{read_at_start / 2**20:.1f} MiB read from storage during start")  # fmt: skip
    assert found == N
    assert t_all < 10.0, f"reopening and finding 100k entries took {t_all:.1f} s"
    # start() reads the index (its integrity check at open, then the lookup view loads its
    # entries), never the objects (100k x 4 KiB = 400 MB): twice the index and 8 MiB at most
    meta = os.path.join(root, META_DIR)
    index_bytes = sum(os.path.getsize(os.path.join(meta, f)) for f in os.listdir(meta)
                      if f.startswith(INDEX_FILE))  # fmt: skip
    assert read_at_start < 2 * index_bytes + 8 * 2**20, (
        f"start() read {read_at_start} bytes (index: {index_bytes}): not the objects"
    )
