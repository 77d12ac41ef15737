"""Cross-process pins of the disk tier: a pin taken in one process is honoured by eviction
in every process sharing the directory, and an expired or dead process's pin is not."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from disk_fault_worker import NAMESPACE, key_of, value
from disk_testutil import WORKER, object_files, run
from lmcache_backend_disk import DiskBackend
from lmcache_backend_disk.pins import DiskPin

from lmcache_core import CacheEngineKey, TieredHierarchy
from lmcache_core.testing import same_bits

CHUNK = 64 * 1024
FIRST = 1000  # keys pinned by the tests; the pressure keys are others


def _b(root: str, max_bytes: int = 1 << 30, **opts: Any) -> DiskBackend:
    return DiskBackend({"path": root, "max_bytes": max_bytes, **opts}, namespace=NAMESPACE)


async def _pressure(root: str, n: int, max_bytes: int) -> None:
    """Another backend (same process) storing ``n`` chunks under a small bound."""
    b = _b(root, max_bytes)
    await b.start()
    try:
        for i in range(n):
            await b.put(CacheEngineKey("pressure", 1, 0, i + 1, "uint8"), value(i, 0, CHUNK))
    finally:
        await b.close()


def _pinner(root: str, ttl: float, first: int, n: int) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, WORKER, "pinner", root, str(ttl), str(first), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"pinner failed: {proc.communicate()[1][-3000:]}")
    return proc, int(json.loads(line)["pinned"])


def _fill(root: str, first: int, n: int) -> None:
    async def body() -> None:
        b = _b(root)
        await b.start()
        try:
            keys = [key_of(first + i) for i in range(n)]
            assert all(await b.batched_put(keys, [value(first + i, 0, CHUNK) for i in range(n)]))
        finally:
            await b.close()

    run(body())


def _present(root: str, first: int, n: int) -> list[bool]:
    async def body() -> list[bool]:
        b = _b(root)
        await b.start()
        try:
            got = [await b.get(key_of(first + i)) for i in range(n)]
        finally:
            await b.close()
        for i, g in enumerate(got):
            assert g is None or same_bits(g, value(first + i, 0, CHUNK))
        return [g is not None for g in got]

    return run(body())


# ----------------------------------------------------------------------------- one process
def test_pins_block_eviction_until_unpinned_or_expired(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")

    async def body() -> None:
        b = _b(root, max_bytes=12 * CHUNK)
        await b.start()
        try:
            keys = [key_of(FIRST + i) for i in range(4)]
            assert all(await b.batched_put(keys, [value(i, 0, CHUNK) for i in range(4)]))
            assert b.pin(CacheEngineKey("absent", 1, 0, 1, "uint8")) is None
            h = b.pin_many(keys[:2])
            assert all(isinstance(x, DiskPin) for x in h)
            short = b.pin(keys[2], ttl_s=0.3)
            assert short is not None
            nested = b.pin(keys[0])  # pins nest
            time.sleep(0.35)  # keys[2]'s pin has expired
            for i in range(20):  # pressure: evicts everything evictable
                await b.put(CacheEngineKey("p", 1, 0, i + 1, "uint8"), value(i, 1, CHUNK))
            assert [await b.contains(k) for k in keys] == [True, True, False, False]
            b.unpin_many([x for x in h if x is not None])
            for i in range(20, 40):
                await b.put(CacheEngineKey("p", 1, 0, i + 1, "uint8"), value(i, 1, CHUNK))
            # keys[0] still has its nested pin; keys[1] is unpinned
            assert [await b.contains(k) for k in keys] == [True, False, False, False]
            assert nested is not None
            b.unpin(nested)
            with pytest.raises(TypeError):
                b.unpin("not a handle")
            with pytest.raises(ValueError):
                b.pin(keys[0], ttl_s=float("nan"))
            assert b.stats()["pins"] == 4
        finally:
            await b.close()
        assert b.pin_many(keys) == [None] * 4  # closed: nothing pinned, nothing raised

    run(body())


def test_full_of_pins_refuses_stores_instead_of_evicting(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")

    async def body() -> None:
        b = _b(root, max_bytes=3 * CHUNK + 3 * 4096 + 100)
        await b.start()
        try:
            keys = [key_of(FIRST + i) for i in range(3)]
            assert all(await b.batched_put(keys, [value(i, 0, CHUNK) for i in range(3)]))
            handles = b.pin_many(keys)
            assert not await b.put(key_of(FIRST + 3), value(3, 0, CHUNK))
            assert all([await b.contains(k) for k in keys])
            b.unpin_many([h for h in handles if h is not None])
            assert await b.put(key_of(FIRST + 3), value(3, 0, CHUNK))
        finally:
            await b.close()

    run(body())


def test_hierarchy_leases_pin_disk_chunks(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")

    async def body() -> None:
        cfg = {
            "tiers": [
                {"name": "d", "backend": "disk", "options": {"path": root, "max_bytes": "4MiB"}}
            ]
        }
        h = TieredHierarchy.from_config(cfg, namespace=NAMESPACE)
        await h.start()
        try:
            keys = [key_of(FIRST + i) for i in range(3)]
            for i, k in enumerate(keys):
                await h.put(k, value(i, 0, CHUNK))
            await h.flush()
            found = await h.lookup_prefix(keys, lease_s=30)
            assert found.num_hit == 3 and found.leased == 3
            disk = h.tiers[0].backend
            assert isinstance(disk, DiskBackend)
            with disk.index.snapshot() as tx:
                assert tx.pinned_count(time.time()) == 3
            assert await h.release(keys) == 3
            with disk.index.snapshot() as tx:
                assert tx.pinned_count(time.time()) == 0
        finally:
            await h.close()

    run(body())


# ----------------------------------------------------------------------------- two processes
def test_a_pin_in_another_process_survives_eviction_pressure(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")
    _fill(root, FIRST, 8)
    proc, pinned = _pinner(root, 600.0, FIRST, 4)  # pins the first 4 of the 8
    try:
        assert pinned == 4
        run(_pressure(root, 60, max_bytes=16 * (CHUNK + 4096)))
        assert _present(root, FIRST, 8) == [True] * 4 + [False] * 4
    finally:
        _out, err = proc.communicate("", timeout=60)
    assert proc.returncode == 0, err[-3000:]
    run(_pressure(root, 60, max_bytes=16 * (CHUNK + 4096)))  # unpinned now
    assert _present(root, FIRST, 4) == [False] * 4


def test_an_expired_pin_does_not_protect(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")
    _fill(root, FIRST, 4)
    proc, pinned = _pinner(root, 0.5, FIRST, 4)
    try:
        assert pinned == 4
        time.sleep(0.7)
        run(_pressure(root, 40, max_bytes=16 * (CHUNK + 4096)))
        assert _present(root, FIRST, 4) == [False] * 4  # the process is alive, its pin expired
    finally:
        proc.communicate("", timeout=60)


def test_pins_of_a_killed_process_are_dropped(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")
    _fill(root, FIRST, 4)
    proc, pinned = _pinner(root, 600.0, FIRST, 4)
    assert pinned == 4
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    # room held by a dead process's pins is settled when a store finds no room
    run(_pressure(root, 40, max_bytes=8 * (CHUNK + 4096)))
    assert _present(root, FIRST, 4) == [False] * 4
    assert len(object_files(root)) <= 8


def test_pins_race_a_concurrent_evictor(tmp_path: Path) -> None:
    """While another process evicts continuously, every pin that pin_many returns holds
    until unpinned, while unpinned chunks stored at the same moment are evicted."""
    root = str(tmp_path / "tier")
    bound = 12 * (CHUNK + 4096)
    writer = subprocess.Popen(
        [sys.executable, WORKER, "writer", root, "120", str(bound), str(CHUNK), "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    async def body() -> tuple[int, int, int]:
        b = _b(root, bound)
        await b.start()
        held = lost = rounds = 0
        try:
            for r in range(3):
                keys = [key_of(FIRST + 8 * r + i) for i in range(8)]
                vals = [value(FIRST + 8 * r + i, 0, CHUNK) for i in range(8)]
                stored = await b.batched_put(keys, vals)
                handles = b.pin_many([k for k, ok in zip(keys[:4], stored, strict=False) if ok])
                pinned = [h for h in handles if h is not None]
                # hold the pins until the other process has evicted every unpinned chunk
                t_end = time.monotonic() + 60
                while any(await b.batched_contains(keys[4:])) and time.monotonic() < t_end:
                    await asyncio.sleep(0.05)
                rounds += not any(await b.batched_contains(keys[4:]))
                held += len(pinned)
                for h in pinned:
                    lost += not os.path.exists(os.path.join(b.root, h.location))
                b.unpin_many(pinned)
        finally:
            await b.close()
        return held, lost, rounds

    try:
        held, lost, rounds = run(body())
    finally:
        writer.kill()
        writer.communicate(timeout=60)
    assert rounds == 3, f"the other process evicted the unpinned chunks in {rounds} of 3 rounds"
    assert held >= 9 and lost == 0, (held, lost)
