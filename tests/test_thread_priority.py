"""No thread that runs Python is niced by default.

A niced thread takes the GIL like any other; when other processes (or vLLM's compute
threads) load every core, the kernel gives a nice-10 or nice-19 thread so little CPU that
it holds the GIL, or is handed it, while it waits for a CPU, and the event loop waits
with it: on 2 cores with two busy-loop processes, the write-through hierarchy's loop
stalled up to ~1 s with its spare-buffer thread at nice 19 (docs/architecture.md,
"Threads run at the process's priority"). Every thread a backend or the hierarchy starts
must therefore run at the priority of the thread that started it. Each case starts a
backend with its default options, stores a few 4 MiB values, and reads the niceness of
every ``lmcache-*`` thread (about a second in all).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_core import TieredHierarchy
from lmcache_core.hierarchy.staging import StagingPool
from lmcache_core.keys import Namespace
from lmcache_core.testing import make_key, random_tensor

MiB = 1 << 20
NS = Namespace(model_name="thread-priority", chunk_size=64)


def _lmcache_thread_nices() -> dict[str, int]:
    """Niceness of every live ``lmcache-*`` thread of this process, by thread name."""
    out: dict[str, int] = {}
    for t in threading.enumerate():
        if t.native_id is None or not t.name.startswith("lmcache"):
            continue
        try:
            out[t.name] = os.getpriority(os.PRIO_PROCESS, t.native_id)
        except OSError:  # the thread ended meanwhile
            pass
    return out


def _base() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _check_backend(make: Callable[[], Any], expect_prefix: str) -> None:
    base = _base()

    async def body() -> dict[str, int]:
        b = make()
        await b.start()
        try:
            vals = [random_tensor((4 * MiB,), torch.uint8, seed=i) for i in range(4)]
            keys = [make_key(f"prio{i}") for i in range(4)]
            await asyncio.gather(*(b.put(k, v) for k, v in zip(keys, vals, strict=True)))
            for k, v in zip(keys, vals, strict=True):
                got = await b.get(k)
                assert got is not None and torch.equal(got, v)
            await asyncio.sleep(0.05)  # (background stores and top-ups under way)
            return _lmcache_thread_nices()
        finally:
            await b.close()

    nices = asyncio.run(body())
    assert any(name.startswith(expect_prefix) for name in nices), nices
    niced = {name: n for name, n in nices.items() if n != base}
    assert not niced, f"threads niced below the process's priority ({base}): {niced}"


def test_write_through_hierarchy_threads_run_at_the_process_priority() -> None:
    def make() -> TieredHierarchy:
        return TieredHierarchy.from_config(
            {
                "tiers": [
                    {"name": "hot", "backend": "cpu", "options": {"max_bytes": "64MiB"}},
                    {"name": "warm", "backend": "cpu", "options": {"max_bytes": "64MiB"}},
                ]
            }
        )

    _check_backend(make, "lmcache-staging")


def test_staging_pool_spare_thread_runs_at_the_process_priority() -> None:
    base = _base()
    pool = StagingPool(spare_bytes=2 * MiB)
    try:
        pool.take(MiB)
        end = time.monotonic() + 10
        while pool.prefaulted < 2 and time.monotonic() < end:
            time.sleep(0.01)
        nices = _lmcache_thread_nices()
        assert nices.get("lmcache-prefault") == base, nices
    finally:
        pool.close()


def test_blob_io_threads_run_at_the_process_priority(tmp_path: Path) -> None:
    from blob_stores import DirBlobBackend

    _check_backend(
        lambda: DirBlobBackend({"path": str(tmp_path)}, namespace=NS, name="blobprio"),
        "lmcache-blobprio",
    )


def test_disk_io_threads_run_at_the_process_priority(tmp_path: Path) -> None:
    disk = pytest.importorskip("lmcache_backend_disk")
    _check_backend(
        lambda: disk.DiskBackend({"path": str(tmp_path / "tier"), "max_bytes": "64MiB"}),
        "lmcache-disk",
    )


def test_s3_io_threads_run_at_the_process_priority(tmp_path: Path) -> None:
    s3 = pytest.importorskip("lmcache_backend_s3")
    _check_backend(
        lambda: s3.S3Backend({"url": f"file://{tmp_path}/s3"}, namespace=NS),
        "lmcache-s3",
    )


def test_no_niceness_option_defaults_above_zero() -> None:
    """Options that nice a pool of Python threads default to 0 (gds: its POSIX threads;
    the vLLM connector: the worker's copy threads)."""
    from lmcache_core.config.options import build_options
    from lmcache_core.integrations.vllm.settings import ConnectorOptions

    assert build_options(ConnectorOptions, {}).copy_nice == 0
    gds = pytest.importorskip("lmcache_backend_gds.options")
    assert gds.GdsOptions.__dataclass_fields__["io_nice"].default == 0


def test_connector_copy_threads_run_at_the_process_priority_by_default() -> None:
    from lmcache_core.config import load_config
    from lmcache_core.integrations.vllm.storage import COPY_THREAD_PREFIX, Storage

    def me() -> tuple[str, int]:
        return threading.current_thread().name, _base()

    async def hop() -> tuple[str, int]:
        return await asyncio.to_thread(me)

    cfg = load_config({"chunk_size": 32, "tiers": [{"name": "cpu", "backend": "cpu"}]})
    storage = Storage(cfg, NS)
    try:
        name, nice = storage.sync.io.run(hop())
    finally:
        storage.close()
    assert name.startswith(COPY_THREAD_PREFIX) and nice == _base()
