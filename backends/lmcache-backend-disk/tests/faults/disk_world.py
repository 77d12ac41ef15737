"""The world of a disk-tier fault trial: a tier with legitimate objects, a canary tree
outside it holding *forged* objects (valid format, right keys and namespace, other bytes)
and victim files, and a battery of every operation a user (or ``gc``/``verify``) runs.

A trial plants something (a link, a crafted index row, damage), runs the battery and
tallies: wrong bytes served (any hit that is not the legitimate value, including a hit
for a key only the forger has), links followed (``contains`` true for a key reachable
only through a link), crashes (an exception from an operation that must not raise), and
changes outside the tier (the canary: bytes, inodes, inotify events).

The campaign runs a bounded sample with a fixed seed by default, everything with
``LMCACHE_FAULTS_FULL=1`` (``make faults``); ``LMCACHE_FAULTS_LOG=FILE`` appends one JSON
line per campaign (trial counts and results) to FILE. (No ``conftest.py`` here: the name
would clash with ``tests/vllm``'s in one pytest run; this module is found because pytest
puts this directory on ``sys.path``.)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from disk_canary import Canary
from lmcache_backend_disk import DiskBackend, layout

from lmcache_core import CacheEngineKey, Namespace
from lmcache_core.cli.maint import GcRules, gc_tier, verify_tier
from lmcache_core.errors import ConfigError, LMCacheError
from lmcache_core.testing import random_tensor, same_bits

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 300.0) -> T:
    """Run a coroutine to completion (the tests are synchronous)."""

    async def guarded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


FULL = os.environ.get("LMCACHE_FAULTS_FULL", "") not in ("", "0")
#: Seed of the bounded sample run in CI (the full campaign runs everything).
SAMPLE_SEED = 20240611


def sample(items: list[Any], k: int) -> list[Any]:
    """All of ``items`` in the full campaign, else ``k`` of them chosen with a fixed seed."""
    if FULL or k >= len(items):
        return list(items)
    return random.Random(SAMPLE_SEED).sample(items, k)


def phases(trials: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Each trial planted before a backend starts (``False``) and while one is open
    (``True``) in the full campaign; in CI one of the two, chosen with a fixed seed."""
    if FULL:
        return [(*t, hot) for t in trials for hot in (False, True)]
    rnd = random.Random(SAMPLE_SEED)
    return [(*t, rnd.random() < 0.5) for t in trials]


NS = Namespace(model_name="faults", kv_dtype="uint8", block_size=16)
CHUNK = 16 * 1024
OBJ = CHUNK + 4096  # bytes of one object on disk (data + header)
LEGIT = 8  # keys stored legitimately
FORGED_ONLY = 4  # keys only the forger has


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("faults", 1, 0, i + 1, "uint8")


def legit_value(i: int) -> torch.Tensor:
    return random_tensor((CHUNK,), torch.uint8, seed=10_000 + i)


def forged_value(i: int) -> torch.Tensor:
    return random_tensor((CHUNK,), torch.uint8, seed=20_000 + i)


def backend(root: str | Path, max_bytes: int = 1 << 30, **opts: Any) -> DiskBackend:
    return DiskBackend(
        {"path": str(root), "max_bytes": max_bytes, "concurrency": 4, "fsync": False, **opts},
        namespace=NS,
    )


@dataclass
class Tally:
    """Results of trials (all but ``trials`` and ``refused`` must stay 0)."""

    trials: int = 0
    wrong_bytes: int = 0
    links_followed: int = 0
    crashes: int = 0
    outside_touched: int = 0
    bound_exceeded: int = 0
    inconsistent: int = 0
    refused: int = 0
    reported: int = 0  # errors maintenance calls reported (LMCacheError), not crashes
    notes: list[str] = field(default_factory=list)

    def crash(self, what: str, exc: BaseException) -> None:
        self.crashes += 1
        self.notes.append(f"crash in {what}: {type(exc).__name__}: {exc}")

    def add(self, other: Tally) -> None:
        for f in ("trials", "wrong_bytes", "links_followed", "crashes", "outside_touched",
                  "bound_exceeded", "inconsistent", "refused", "reported"):  # fmt: skip
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.notes.extend(other.notes)

    def failures(self) -> int:
        return (
            self.wrong_bytes
            + self.links_followed
            + self.crashes
            + self.outside_touched
            + self.bound_exceeded
            + self.inconsistent
        )

    def report(self, campaign: str) -> str:
        """Log the tally (``LMCACHE_FAULTS_LOG``) and return a one-line summary
        (``FAULTS <campaign>: <json>``, the core campaign's prefix)."""
        record = {"campaign": campaign, "full": FULL, **asdict(self)}
        record["notes"] = self.notes[:20]
        line = json.dumps(record)
        log = os.environ.get("LMCACHE_FAULTS_LOG")
        if log:
            with open(log, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        return f"\nFAULTS {campaign}: {line}"


class World:
    """A tier (``<tmp>/tier``) with :data:`LEGIT` objects and a canary tree
    (``<tmp>/canary``) holding a forged copy of a tier and victim files."""

    def __init__(self, tmp: Path, rnd: random.Random, nested: bool = False) -> None:
        """``nested``: the namespace in layout 1 (``ns-…/ab/cd/<name>``, what versions
        before layout 2 wrote) instead of layout 2."""
        self.tmp = tmp
        self.nested = nested
        self.rnd = rnd
        self.root = tmp / "tier"
        self.canary_dir = tmp / "canary"
        self.forged_root = self.canary_dir / "forged-tier"
        self.victim = self.canary_dir / "victim"
        self.canary = Canary(str(self.canary_dir))
        self.ns_dir = ""
        self.legit: dict[int, torch.Tensor] = {}
        self.stored: dict[int, torch.Tensor] = {}  # what the battery stored itself

    def _prepare_layout(self, root: Path) -> None:
        if self.nested:  # a layout-1 namespace directory makes the backend keep layout 1
            ns_json = layout.namespace_json(NS)
            (root / layout.namespace_dir(ns_json, flat=False)).mkdir(parents=True, mode=0o700)

    async def build(self) -> None:
        self._prepare_layout(self.root)
        self._prepare_layout(self.forged_root)
        b = backend(self.root)
        await b.start()
        try:
            ok = await b.batched_put(
                [key(i) for i in range(LEGIT)], [legit_value(i) for i in range(LEGIT)]
            )
            assert all(ok)
            ns_dir = b._ns_dir
        finally:
            await b.close()
        assert layout.is_flat(ns_dir) != self.nested
        self.ns_dir = ns_dir
        self.legit = {i: legit_value(i) for i in range(LEGIT)}
        f = backend(self.forged_root)
        await f.start()
        try:
            n = LEGIT + FORGED_ONLY
            assert all(
                await f.batched_put([key(i) for i in range(n)], [forged_value(i) for i in range(n)])
            )
        finally:
            await f.close()
        self.victim.mkdir(parents=True)
        (self.victim / ".bashrc").write_text("export IMPORTANT=1\n")
        (self.victim / "notes.txt").write_text("do not delete\n")
        (self.victim / "0123456789abcdef").write_text("looks like an owner file\n")
        (self.victim / ".0123456789abcdef.new").write_text("looks like a stale owner file\n")
        old = time.time() - 3600
        for p in self.victim.iterdir():
            os.utime(p, (old, old))
        (self.victim / "db.sqlite").write_bytes(
            (self.forged_root / ".lmcache-disk" / "index.sqlite").read_bytes()
        )
        os.mkfifo(self.victim / "fifo")

    def clone(self, tmp: Path, rnd: random.Random) -> World:
        """A copy of this (built, idle) world under ``tmp``: trials share one build."""
        tmp.mkdir(parents=True)
        for name in ("tier", "canary"):
            shutil.copytree(self.tmp / name, tmp / name, symlinks=True, ignore=_no_fifo)
        w = World(tmp, rnd, self.nested)
        w.ns_dir = self.ns_dir
        w.legit = dict(self.legit)
        os.mkfifo(w.victim / "fifo")
        return w

    # -- where things are
    def rel(self, i: int) -> str:
        return layout.object_relpath(self.ns_dir, key(i))

    def forged(self, rel: str) -> Path:
        return self.forged_root / rel

    # -- planting
    def replace_with_link(self, rel: str, target: Path) -> None:
        """Replace ``tier/rel`` (file or directory) with a symbolic link to ``target``."""
        path = self.root / rel if rel else self.root
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)

    # -- the battery
    async def battery(self, tally: Tally, b: DiskBackend | None = None, pressure: int = 12) -> None:
        """Every operation against the tier (``b`` already started, or a new backend)."""
        rnd = self.rnd
        if b is None:
            b = backend(self.root, max_bytes=(LEGIT + 4) * OBJ)
            try:
                await b.start()
            except ConfigError:
                tally.refused += 1
                return
            except Exception as exc:
                tally.crash("start", exc)
                return
        try:
            await self._ops(b, tally, rnd, pressure)
        finally:
            try:
                await b.close()
            except Exception as exc:
                tally.crash("close", exc)

    async def _ops(self, b: DiskBackend, tally: Tally, rnd: random.Random, pressure: int) -> None:
        everything = list(range(LEGIT + FORGED_ONLY))

        async def guarded(what: str, coro: Any, report: bool = False) -> Any:
            try:
                return await coro
            except LMCacheError as exc:
                if not report:
                    tally.crash(what, exc)
                else:  # maintenance reports what it cannot do (the CLI prints it)
                    tally.reported += 1
                    tally.notes.append(f"reported by {what}: {exc}")
                return None
            except Exception as exc:
                tally.crash(what, exc)
                return None

        def check_hit(i: int, got: torch.Tensor | None) -> None:
            if got is None:
                return
            want = self.stored.get(i, self.legit.get(i))
            if want is None or not same_bits(got, want):
                tally.wrong_bytes += 1
                tally.notes.append(f"wrong bytes for key {i}")

        found = await guarded("batched_contains", b.batched_contains([key(i) for i in everything]))
        for i, hit in zip(everything, found or [], strict=False):
            if hit and i not in self.legit and i not in self.stored:
                tally.links_followed += 1
                tally.notes.append(f"contains({i}) true for a forged-only key")
        for i in rnd.sample(everything, len(everything)):
            check_hit(i, await guarded("get", b.get(key(i))))
            out = torch.empty(CHUNK, dtype=torch.uint8)
            if await guarded("get_into", b.get_into(key(i), out)):
                check_hit(i, out)
        handles: list[Any] = []
        if rnd.random() < 0.5:
            try:
                handles = b.pin_many([key(i) for i in everything])
            except Exception as exc:
                tally.crash("pin_many", exc)
        # pressure: stores evict (through whatever was planted) under the small bound
        for _ in range(pressure):
            i = 100 + rnd.randrange(1000)
            v = random_tensor((CHUNK,), torch.uint8, seed=i)
            if await guarded("put", b.put(key(i), v)):
                self.stored[i] = v
        batch = [100 + rnd.randrange(1000) for _ in range(4)]
        vals = [random_tensor((CHUNK,), torch.uint8, seed=i) for i in batch]
        res = await guarded("batched_put", b.batched_put([key(i) for i in batch], vals))
        for i, v, ok in zip(batch, vals, res or [], strict=False):
            if ok:
                self.stored[i] = v
        held = tier_object_bytes(self.root)
        if held > b.max_bytes:  # checked before gc trims the tier
            tally.bound_exceeded += 1
            tally.notes.append(f"after the stores the tier holds {held} > {b.max_bytes} bytes")
        for i in list(self.stored)[:6]:
            check_hit(i, await guarded("get stored", b.get(key(i))))
        try:
            b.unpin_many([h for h in handles if h is not None])
        except Exception as exc:
            tally.crash("unpin_many", exc)
        for i in rnd.sample(everything, 3):
            await guarded("remove", b.remove(key(i)))
            self.legit.pop(i, None)
            self.stored.pop(i, None)
        await guarded("reconcile", b.reconcile(), report=True)
        await guarded("scan", _drain(b), report=True)
        await guarded("verify", verify_tier(b, delete=True), report=True)
        await guarded("gc", gc_tier(b, GcRules(max_bytes=(LEGIT + 2) * OBJ)), report=True)
        await guarded("usage", b.usage(), report=True)
        await guarded("namespaces", b.namespaces(), report=True)

    async def final_checks(self, tally: Tally, max_bytes: int) -> None:
        """After the trial: the tier holds at most ``max_bytes`` of objects, and a
        reconciled index agrees with the files."""
        total = tier_object_bytes(self.root)
        if total > max_bytes:
            tally.bound_exceeded += 1
            tally.notes.append(f"tier holds {total} bytes > {max_bytes}")
        b = backend(self.root, max_bytes=max_bytes)
        try:
            await b.start()
        except ConfigError:
            return
        try:
            await b.reconcile()
            usage = await b.usage()
            if usage["used_bytes"] != tier_object_bytes(self.root):
                tally.inconsistent += 1
                tally.notes.append(f"usage {usage} != files {tier_object_bytes(self.root)}")
        except Exception as exc:
            tally.crash("final reconcile", exc)
        finally:
            await b.close()


def _no_fifo(directory: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "fifo"]


async def _drain(b: DiskBackend) -> int:
    n = 0
    async for _ in b.scan(read_headers=True):
        n += 1
    return n


def tier_object_bytes(root: Path) -> int:
    """Bytes of the object files under ``root`` (links not followed)."""
    total = 0
    if root.is_symlink() or not root.is_dir():
        return 0
    for dirpath, _dirs, files in os.walk(root):
        if ".lmcache-disk" in dirpath:
            continue
        for f in files:
            p = os.path.join(dirpath, f)
            if len(f) == 32 and not os.path.islink(p):
                total += os.lstat(p).st_size
    return total
