"""The in-memory view of the keys (lookups without an ``lstat`` per key) and its
coherence rules: this process's own changes are visible to its next lookup, another
process's within ``lookup_refresh_s``; a stale positive is a miss at load, never wrong
bytes."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from disk_testutil import run
from lmcache_backend_disk import DiskBackend

from lmcache_core import CacheEngineKey, Namespace, SyncBackend
from lmcache_core.testing import random_tensor, same_bits

NS = Namespace(model_name="view", kv_dtype="uint8")
CHUNK = 64 * 1024
OBJ = CHUNK + 4096  # an object on disk: data + header


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("view", 1, 0, i + 1, "uint8")


def _val(i: int, gen: int = 0) -> torch.Tensor:
    return random_tensor((CHUNK,), torch.uint8, seed=1000 * gen + i)


def _b(root: Path, **opts: object) -> DiskBackend:
    return DiskBackend({"path": str(root), "fsync": False, **opts}, namespace=NS)


def test_own_changes_are_visible_to_the_next_lookup(tmp_path: Path) -> None:
    """Puts, removals and another same-process backend's evictions: at once, even with a
    long refresh interval (this process's commits make the view catch up)."""
    root = tmp_path / "tier"

    async def body() -> None:
        a = _b(root, lookup_refresh_s=60, max_bytes=4 * OBJ)
        b = _b(root, lookup_refresh_s=60, max_bytes=4 * OBJ)
        await a.start()
        await b.start()
        try:
            keys = [_key(i) for i in range(8)]
            assert await a.batched_contains(keys) == [False] * 8
            assert all(await a.batched_put(keys[:4], [_val(i) for i in range(4)]))
            assert await a.batched_contains(keys) == [True] * 4 + [False] * 4
            assert a.try_batched_contains_threadsafe(keys[:4]) == [True] * 4
            assert await b.batched_contains(keys[:4]) == [True] * 4
            assert all(await b.batched_put(keys[4:], [_val(i) for i in range(4, 8)]))  # evicts
            assert await a.batched_contains(keys) == [False] * 4 + [True] * 4
            assert await a.remove(keys[5])
            assert await b.batched_contains(keys[4:]) == [True, False, True, True]
            assert a._view is not None and a._view.reloads == 1, "caught up incrementally"
        finally:
            await a.close()
            await b.close()

    run(body())


def test_a_view_far_behind_the_pruned_log_reloads(tmp_path: Path) -> None:
    root = tmp_path / "tier"

    async def body() -> None:
        a = _b(root, lookup_refresh_s=60)
        b = _b(root, lookup_refresh_s=60)
        await a.start()
        await b.start()
        try:
            keys = [_key(i) for i in range(6)]
            assert await a.batched_contains(keys) == [False] * 6
            assert all(await b.batched_put(keys, [_val(i) for i in range(6)]))
            assert await b.remove(keys[0])
            with b.index.transaction() as tx:
                assert tx.prune_changes(keep=2) > 0
                floor = tx.meta("changes_floor")
            assert floor is not None and int(floor) > 0
            reloads = a._view.reloads if a._view is not None else 0
            assert await a.batched_contains(keys) == [False] + [True] * 5
            assert a._view is not None and a._view.reloads == reloads + 1
        finally:
            await a.close()
            await b.close()

    run(body())


def test_forged_change_rows_are_misses_at_load(tmp_path: Path) -> None:
    """A row in the change log is a hint: a location without an object is a stale
    positive, a miss at load; paths of any other shape never enter the view."""
    root = tmp_path / "tier"

    async def body() -> None:
        a = _b(root, lookup_refresh_s=0)
        await a.start()
        try:
            rel = a._rel(_key(0))
            with a.index.transaction() as tx:
                con = tx._con
                con.execute("INSERT INTO changes(path, present) VALUES (?, 1)", (rel,))
                con.execute("INSERT INTO changes(path, present) VALUES ('../../x', 1)", ())
            assert await a.contains(_key(0))  # stale positive
            out = torch.zeros(CHUNK, dtype=torch.uint8)
            assert not await a.get_into(_key(0), out)
            assert not bool(out.any())
            assert a._view is not None and all("/" in n and ".." not in n for n in a._view._names)
        finally:
            await a.close()

    run(body())


def _older_version_audit(root: Path) -> None:
    """What the schema audit of a version without the change log does (at its start and
    every ``AUDIT_INTERVAL_S``): the log's triggers are not in its schema, so it drops them
    as foreign (the ``changes`` table, unknown to it, is left alone)."""
    import sqlite3

    con = sqlite3.connect(root / ".lmcache-disk" / "index.sqlite", isolation_level=None)
    try:
        con.execute("BEGIN IMMEDIATE")
        con.execute('DROP TRIGGER "changes_ins"')
        con.execute('DROP TRIGGER "changes_del"')
        con.execute("COMMIT")
    finally:
        con.close()


def test_an_older_version_dropping_the_change_log_never_leaves_a_stale_view(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The schema version was kept (an older process would take a bumped index for
    damage and rebuild it); an older process drops the change log's triggers instead.
    While they are gone, changes are not logged: the view stops answering (lookups check
    the files: right answers, no fast path), and once a newer process's audit restores the
    triggers (new epoch) it reloads, so a change made meanwhile is never missed."""
    root = tmp_path / "tier"

    async def body() -> None:
        a = _b(root, lookup_refresh_s=0)
        b = _b(root, lookup_refresh_s=0)
        await a.start()
        await b.start()
        try:
            keys = [_key(i) for i in range(6)]
            assert all(await b.batched_put(keys[:4], [_val(i) for i in range(4)]))
            assert await a.batched_contains(keys) == [True] * 4 + [False] * 2
            assert a._view is not None
            reloads = a._view.reloads
            with caplog.at_level(logging.WARNING, logger="lmcache_core.disk"):
                _older_version_audit(root)
                # changes made while the log is off: not in the change log
                assert await b.remove(keys[0])
                assert all(await b.batched_put(keys[4:5], [_val(4)]))
                assert a.try_batched_contains_threadsafe(keys) is None
                assert await a.batched_contains(keys) == [False] + [True] * 4 + [False]
                out = torch.zeros(CHUNK, dtype=torch.uint8)
                assert not await a.get_into(keys[0], out)
            assert "change log is off" in caplog.text
            # a newer process starts (its audit restores the triggers, new epoch)
            c = _b(root, lookup_refresh_s=0)
            await c.start()
            await c.close()
            expect = [False] + [True] * 4 + [False]
            assert a.try_batched_contains_threadsafe(keys) == expect
            assert await a.batched_contains(keys) == expect
            assert a._view.reloads == reloads + 1
            assert await a.get_into(keys[4], out) and same_bits(out, _val(4))
            # and the log is trusted again: a later change is seen incrementally
            assert await b.remove(keys[4])
            assert a.try_batched_contains_threadsafe(keys[4:5]) == [False]
            assert a._view.reloads == reloads + 1
        finally:
            await a.close()
            await b.close()

    run(body())


def test_sync_lookups_take_no_hop_and_leases_pin(tmp_path: Path) -> None:
    """``SyncBackend`` answers disk lookups from the calling thread; a hierarchy's
    ``lookup_prefix`` with a lease pins the disk entries from that thread too."""
    from lmcache_core import TieredHierarchy

    root = tmp_path / "tier"
    h = TieredHierarchy.from_config(
        {
            "tiers": [
                {"name": "disk", "backend": "disk", "options": {"path": str(root), "fsync": False}}
            ]
        },
        namespace=NS,
    )
    with SyncBackend(h) as hs:
        keys = [_key(i) for i in range(4)]
        assert all(hs.batched_put(keys[:3], [_val(i) for i in range(3)]))
        disk = h.tiers[0].backend
        assert isinstance(disk, DiskBackend)
        loop_thread = threading.get_ident()
        assert disk.try_batched_contains_threadsafe(keys) == [True, True, True, False]
        assert hs.batched_contains(keys) == [True, True, True, False]
        res = hs.lookup_prefix(keys, lease_s=30)
        assert res.num_hit == 3 and res.leased == 3
        with disk.index.snapshot() as tx:
            assert tx.pinned_count(time.time()) == 3
        # a caller that must not stall (vLLM's engine thread) releases on the loop: an
        # unpin is an index transaction that may wait for the lock
        assert h.try_release_threadsafe(keys, blocking=False) is None
        assert hs.release(keys) == 3
        assert threading.get_ident() == loop_thread


_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys, time
    sys.path.insert(0, {here!r})
    from test_disk_view import _b, _key, _val, OBJ
    from pathlib import Path

    async def main():
        b = _b(Path({root!r}), max_bytes=8 * OBJ)
        await b.start()
        for line in sys.stdin:
            cmd, lo, hi, gen = line.split()
            lo, hi, gen = int(lo), int(hi), int(gen)
            keys = [_key(i) for i in range(lo, hi)]
            if cmd == "put":
                ok = all(await b.batched_put(keys, [_val(i, gen) for i in range(lo, hi)]))
            else:
                ok = all([await b.remove(k) for k in keys])
            print(json.dumps({{"ok": ok, "t": time.time(), "ev": b.stats()["evictions"]}}),
                  flush=True)
        await b.close()

    asyncio.run(main())
    """
)


def test_two_processes_see_each_others_puts_and_evictions(tmp_path: Path) -> None:
    """A put in another process becomes a hit here within ``lookup_refresh_s`` (plus the
    time to notice, bounded generously for a loaded machine); after its evictions and
    overwrites a lookup may still say "stored" until the view catches up, but a load is
    then a miss or the current value, never other bytes."""
    root = tmp_path / "tier"
    refresh = 0.2
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(here=here, root=str(root))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def ask(cmd: str, lo: int, hi: int, gen: int = 0) -> dict[str, object]:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(f"{cmd} {lo} {hi} {gen}\n")
        child.stdin.flush()
        reply = json.loads(child.stdout.readline())
        assert reply["ok"], reply
        return dict(reply)

    async def body() -> None:
        me = _b(root, lookup_refresh_s=refresh, max_bytes=8 * OBJ)
        await me.start()
        try:
            keys = [_key(i) for i in range(16)]
            current: dict[int, torch.Tensor] = {}
            delays = []
            wrong = stale = 0
            for gen in range(3):
                lo = 8 * (gen % 2)
                reply = ask("put", lo, lo + 8, gen)  # the other 8 are evicted
                for i in range(lo, lo + 8):
                    current[i] = _val(i, gen)
                for i in range(8 - lo, 16 - lo):
                    current.pop(i, None)
                # right away: whatever a lookup says, a load is the current value or a miss
                found = me.try_batched_contains_threadsafe(keys)
                assert found is not None
                out = torch.empty(CHUNK, dtype=torch.uint8)
                for i, hit in enumerate(found):
                    got = await me.get_into(keys[i], out)
                    if got and (i not in current or not same_bits(out, current[i])):
                        wrong += 1
                    stale += bool(hit) and i not in current
                # the new puts become hits, the evicted keys misses, within the delay
                while True:
                    found = me.try_batched_contains_threadsafe(keys)
                    if found == [i in current for i in range(16)]:
                        delays.append(time.time() - float(reply["t"]))  # type: ignore[arg-type]
                        break
                    assert time.time() - float(reply["t"]) < refresh + 5.0, found  # type: ignore[arg-type]
                    time.sleep(0.005)
                assert all(await me.batched_get_into(keys[lo : lo + 8], [
                    torch.empty(CHUNK, dtype=torch.uint8) for _ in range(8)]))  # fmt: skip
            ask("remove", 0, 8)
            out = torch.empty(CHUNK, dtype=torch.uint8)
            for i in range(8):
                assert not await me.get_into(keys[i], out)
            assert wrong == 0, f"{wrong} loads served bytes that were not the current value"
            print(f"visibility delays {[round(d, 3) for d in delays]} s; stale hints {stale}")
            assert max(delays) < refresh + 1.0
        finally:
            await me.close()

    try:
        run(body(), timeout=120)
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=60)
    assert child.returncode == 0


def test_leases_taken_from_a_thread_survive_another_process_evicting(tmp_path: Path) -> None:
    """A leasing ``lookup_prefix`` answered in the calling thread pins the disk entries in
    the shared index exactly as the event loop's does: another process filling the tier
    evicts everything but them, and they load bit-exact; once released they can go."""
    from lmcache_core import TieredHierarchy

    root = tmp_path / "tier"
    here = os.path.dirname(os.path.abspath(__file__))
    h = TieredHierarchy.from_config(
        {
            "tiers": [
                {
                    "name": "disk",
                    "backend": "disk",
                    "options": {"path": str(root), "fsync": False, "max_bytes": 8 * OBJ},
                }
            ]
        },
        namespace=NS,
    )
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(here=here, root=str(root))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def ask(lo: int, hi: int) -> dict[str, object]:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(f"put {lo} {hi} 1\n")
        child.stdin.flush()
        reply = json.loads(child.stdout.readline())
        assert reply["ok"], reply
        return dict(reply)

    try:
        with SyncBackend(h) as hs:
            keys = [_key(i) for i in range(3)]
            assert all(hs.batched_put(keys, [_val(i) for i in range(3)]))
            res = h.try_lookup_prefix_threadsafe(keys, lease_s=60)  # this thread, no hop
            assert res is not None and res.num_hit == 3 and res.pinned == (True,) * 3
            disk = h.tiers[0].backend
            assert isinstance(disk, DiskBackend)
            with disk.index.snapshot() as tx:
                assert tx.pinned_count(time.time()) == 3
            for lo in range(100, 116, 4):  # 16 chunks into the 5 free places, 4 at a time
                ev = int(ask(lo, lo + 4)["ev"])  # type: ignore[call-overload]
            assert ev >= 11  # it evicted all it could: its own chunks, never the pinned
            out = torch.empty(CHUNK, dtype=torch.uint8)
            for i, k in enumerate(keys):
                assert hs.get_into(k, out) and same_bits(out, _val(i))
            assert hs.release(keys) == 3
            for lo in range(116, 124, 4):  # unpinned now: evicted by the next fill
                ask(lo, lo + 4)
            assert hs.batched_contains(keys) == [False] * 3
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=60)
