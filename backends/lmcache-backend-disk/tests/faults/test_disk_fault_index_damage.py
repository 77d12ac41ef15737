"""A damaged, deleted or replaced index. Random pages of the index file are corrupted
(bytes overwritten, a page zeroed, the file truncated) with no backend open and while one
runs; the index file is deleted or replaced by an older copy under two running backends.
Afterwards the index is rebuilt (or reopened and brought in line with the files), stores
resume, reads serve the stored bytes or miss, ``verify`` and ``gc`` report without
raising, and the directory stays within its bound (one index, not two)."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import sqlite3
import time
from pathlib import Path

import torch
from disk_world import FULL, NS, Tally, run, tier_object_bytes
from lmcache_backend_disk import DiskBackend

from lmcache_core import CacheEngineKey
from lmcache_core.cli.maint import GcRules, gc_tier, verify_tier
from lmcache_core.testing import random_tensor, same_bits

COLD_TRIALS = 200 if FULL else 6
HOT_TRIALS = 50 if FULL else 3
SWAP_TRIALS = 20 if FULL else 2
N = 150  # entries: an index of several pages
VAL = 512
OBJ = VAL + 4096


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("damage", 1, 0, i + 1, "uint8")


def _val(i: int) -> torch.Tensor:
    return random_tensor((VAL,), torch.uint8, seed=i)


def _b(root: Path, max_bytes: int = 1 << 30) -> DiskBackend:
    return DiskBackend(
        {"path": str(root), "max_bytes": max_bytes, "concurrency": 4, "fsync": False},
        namespace=NS,
    )


def _index(root: Path) -> Path:
    return root / ".lmcache-disk" / "index.sqlite"


def _corrupt(path: Path, rnd: random.Random) -> str:
    """Damage the SQLite file at a random page; what was done."""
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big") or 4096
    if page == 1:
        page = 65536
    pages = max(1, len(data) // page)
    p = rnd.randrange(pages)
    how = rnd.choice(["bytes", "bytes", "bytes", "zero", "truncate"])
    if how == "truncate" and pages > 1:
        del data[max(1, p) * page :]
    elif how == "zero":
        data[p * page : (p + 1) * page] = bytes(page)
    else:
        at = p * page + rnd.randrange(page)
        n = rnd.randint(1, 64)
        data[at : at + n] = rnd.randbytes(min(n, len(data) - at))
    path.write_bytes(bytes(data))
    return f"{how} page {p} of {pages}"


async def _fill(root: Path) -> None:
    b = _b(root)
    await b.start()
    try:
        assert all(await b.batched_put([_key(i) for i in range(N)], [_val(i) for i in range(N)]))
    finally:
        await b.close()


async def _check(b: DiskBackend, tally: Tally, what: str, rnd: random.Random) -> None:
    """Reads serve the stored bytes or miss; stores resume; verify and gc report."""
    for i in rnd.sample(range(N), 20):
        got = await b.get(_key(i))
        if got is not None and not same_bits(got, _val(i)):
            tally.wrong_bytes += 1
            tally.notes.append(f"{what}: wrong bytes for {i}")
    await b.put(_key(N + 9), _val(N + 9))  # may meet the damage: a rebuild starts
    await b.reconcile() if rnd.random() < 0.3 else None
    if not await _wait_usable(b):
        tally.inconsistent += 1
        tally.notes.append(f"{what}: the index stayed unusable ({b.index.unavailable})")
        return
    ok = True
    for i in range(N, N + 5):
        ok &= await b.put(_key(i), _val(i))
        got = await b.get(_key(i))
        ok &= got is not None and same_bits(got, _val(i))
    if not ok:
        tally.inconsistent += 1
        tally.notes.append(f"{what}: stores did not resume ({b.stats()})")
    report = await verify_tier(b)
    if report["bad"]:
        tally.inconsistent += 1
        tally.notes.append(f"{what}: verify found {report['bad_objects'][:3]}")
    gc = await gc_tier(b, GcRules(max_bytes=(N - 10) * OBJ))
    if gc["remaining"]["bytes"] > (N - 10) * OBJ:
        tally.inconsistent += 1
        tally.notes.append(f"{what}: gc left {gc['remaining']}")
    usage = await b.usage()
    if usage["used_bytes"] != tier_object_bytes(b.tier_path):  # type: ignore[attr-defined]
        await b.reconcile()
        usage = await b.usage()
        if usage["used_bytes"] != tier_object_bytes(b.tier_path):  # type: ignore[attr-defined]
            tally.inconsistent += 1
            tally.notes.append(f"{what}: usage {usage} after reconcile")


async def _wait_usable(b: DiskBackend, seconds: float = 30.0) -> bool:
    t_end = time.monotonic() + seconds
    while b.index.unavailable is not None and time.monotonic() < t_end:
        await asyncio.sleep(0.02)
    return b.index.unavailable is None


def _cold_trial(tmp: Path, seed: int, tally: Tally) -> None:
    rnd = random.Random(seed)
    root = tmp / "tier"

    async def body() -> None:
        await _fill(root)
        what = _corrupt(_index(root), rnd)
        b = _b(root)
        b.tier_path = root  # type: ignore[attr-defined]
        try:
            await b.start()
        except Exception as exc:
            tally.crash(f"start after {what}", exc)
            return
        try:
            await _check(b, tally, what, rnd)
        finally:
            await b.close()
        again = _b(root)  # a healed index opens as is, no second rebuild
        await again.start()
        rebuilt = again.stats()["index_rebuilds"]
        await again.close()
        if rebuilt:
            tally.inconsistent += 1
            tally.notes.append(f"{what}: rebuilt again at the next start")

    try:
        run(body(), timeout=120)
    except Exception as exc:
        tally.crash("cold trial", exc)


def _hot_trial(tmp: Path, seed: int, tally: Tally) -> None:
    rnd = random.Random(seed)
    root = tmp / "tier"

    async def body() -> None:
        await _fill(root)
        b = _b(root, max_bytes=(N + 20) * OBJ)
        b.tier_path = root  # type: ignore[attr-defined]
        await b.start()
        try:
            con = sqlite3.connect(_index(root), timeout=30)
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            con.close()
            what = "while open: " + _corrupt(_index(root), rnd)
            try:  # another process's write: the running backend reads pages anew
                con = sqlite3.connect(_index(root), timeout=30)
                con.execute("INSERT OR REPLACE INTO meta(k, v) VALUES ('poke', ?)", (str(seed),))
                con.commit()
                con.close()
            except sqlite3.Error:
                pass
            for i in range(N, N + 40):  # stores (and evictions) read the damaged pages
                await b.put(_key(i), _val(i))
            await b.reconcile() if rnd.random() < 0.5 else None
            if not await _wait_usable(b):
                tally.inconsistent += 1
                tally.notes.append(f"{what}: the index stayed unusable")
                return
            await _check(b, tally, what, rnd)
        except Exception as exc:
            tally.crash("hot trial", exc)
        finally:
            await b.close()

    try:
        run(body(), timeout=120)
    except Exception as exc:
        tally.crash("hot trial", exc)


def test_index_corruption_at_random_pages(tmp_path: Path) -> None:
    total = Tally()
    for t in range(COLD_TRIALS):
        tally = Tally(trials=1)
        _cold_trial(tmp_path / f"cold-{t}", 1000 + t, tally)
        total.add(tally)
        shutil.rmtree(tmp_path / f"cold-{t}", ignore_errors=True)
    for t in range(HOT_TRIALS):
        tally = Tally(trials=1)
        _hot_trial(tmp_path / f"hot-{t}", 2000 + t, tally)
        total.add(tally)
        shutil.rmtree(tmp_path / f"hot-{t}", ignore_errors=True)
    print(total.report("disk-index-corruption"))
    assert total.trials == COLD_TRIALS + HOT_TRIALS
    assert total.failures() == 0, total.notes[:30]


def test_index_deleted_or_replaced_under_two_backends(tmp_path: Path) -> None:
    """Two running backends, the index deleted (or replaced by an older copy): both end
    up on one index file and the directory stays within its bound."""
    total = Tally()
    bound = 40 * OBJ
    for t in range(SWAP_TRIALS):
        tally = Tally(trials=1)
        root = tmp_path / f"swap-{t}" / "tier"
        how = ["deleted", "replaced"][t % 2]

        async def body(root: Path = root, how: str = how, tally: Tally = tally) -> None:
            a, b = _b(root, bound), _b(root, bound)
            await a.start()
            await b.start()
            try:
                for i in range(30):
                    await (a if i % 2 else b).put(_key(i), _val(i))
                old = root.parent / "old.sqlite"
                if how == "replaced":
                    con = sqlite3.connect(_index(root), timeout=30)
                    con.execute("VACUUM INTO ?", (str(old),))
                    con.close()
                for i in range(30, 60):
                    await (a if i % 2 else b).put(_key(i), _val(i))
                for suffix in ("", "-wal", "-shm"):
                    p = Path(str(_index(root)) + suffix)
                    if how == "deleted" and p.exists():
                        p.unlink()
                if how == "replaced":
                    os.replace(old, _index(root))
                peak = 0
                for i in range(60, 200):
                    await (a if i % 2 else b).put(_key(i), _val(i))
                    peak = max(peak, tier_object_bytes(root))
                assert await _wait_usable(a) and await _wait_usable(b)
                for i in range(200, 210):
                    await (a if i % 2 else b).put(_key(i), _val(i))
                    peak = max(peak, tier_object_bytes(root))
                if peak > bound + 2 * OBJ:  # in flight while the index was swapped
                    tally.bound_exceeded += 1
                    tally.notes.append(f"{how}: the tier reached {peak} > {bound}")
                if tier_object_bytes(root) > bound:
                    tally.bound_exceeded += 1
                    tally.notes.append(f"{how}: the tier holds {tier_object_bytes(root)} > {bound}")
                current = a.index.current_ident()
                if not (a.index.ident == b.index.ident == current):
                    tally.inconsistent += 1
                    tally.notes.append(f"{how}: two indexes ({a.index.ident}, {b.index.ident})")
                for i in range(200, 210):
                    got = await a.get(_key(i))
                    if got is not None and not same_bits(got, _val(i)):
                        tally.wrong_bytes += 1
            finally:
                await a.close()
                await b.close()

        try:
            run(body(), timeout=120)
        except Exception as exc:
            tally.crash(f"{how} trial", exc)
        total.add(tally)
    print(total.report("disk-index-swapped"))
    assert total.trials == SWAP_TRIALS
    assert total.failures() == 0, total.notes[:30]
