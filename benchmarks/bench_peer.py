"""lmcache-core side by side with its closest peer, LMCache 0.5.6, on the same machine.

Run with ``make bench-peer`` (it creates ``.venv-peer`` with ``lmcache==0.5.6``, the
project and the pinned CPU torch, then runs this file there). Not part of ``make test``
or ``make bench``. Each run is one process holding both libraries; the workloads of a
run go through both, interleaved, on the same chunks:

* token database: a 32k-token prompt in 256-token chunks, as a list, a torch tensor and
  a numpy array (LMCache hashes with Python's ``hash`` when vLLM is absent, as here);
* cpu tier: ``put`` of new 4 MiB chunks into a full tier (each put evicts), ``get`` of
  stored chunks into a caller buffer, ``contains`` of one key, ``batched_contains`` of
  128 keys, and a 128-key lookup that pins the hits, then unpins them -- ours through
  ``SyncBackend`` from a plain thread, LMCache's ``LocalCPUBackend`` called directly
  (its put = ``allocate`` + ``copy_`` + ``submit_put_task``; its get = ``get_blocking``
  + ``copy_`` into the caller's buffer);
* disk tier, 4 MiB and 32 MiB chunks (``--mib``): durable put (ours: ``batched_put``,
  which returns once the objects and their directory are fsynced; LMCache: its
  ``batched_submit_put_task`` + waiting for its background writes + fsync of each file
  and its directory, in buffered and in ``use_odirect`` mode); cold reads into caller
  buffers -- ours into 4 KiB-aligned buffers, plain ``torch.empty`` buffers and bf16
  views of one aligned staging area, LMCache's ``batched_get_blocking`` + copying into
  the plain buffers; the raw baseline: the best of ``O_DIRECT`` ``pwritev`` / ``preadv``
  of the same bytes with 1, 4 and 16 requests in flight, requests of 4 MiB and, for
  32 MiB chunks, of whole files (writes preallocate each file, then fsync each file and
  the directory). Before every cold read the files read are dropped
  from the page cache (``posix_fadvise(DONTNEED)``) and checked with ``mincore``; every
  read is compared bit for bit with what was written;
* disk tier lookups of 128 present keys: ours ``batched_contains`` and a hierarchy's
  ``lookup_prefix`` through ``SyncBackend``; LMCache's ``batched_contains``.

Ratios are speed ratios: the other's time / ours (> 1: lmcache-core is faster), per run
the ratio of the medians of that run's repetitions. Each figure carries its A/A spread:
for cheap workloads each contender runs twice under two names, interleaved; for disk
workloads the even repetitions against the odd ones. The summary gives every run's ratio
and their median.

    make bench-peer                      # 3 runs x 7 repetitions
    .venv-peer/bin/python benchmarks/bench_peer.py --runs 3 --reps 7 [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _storage import (  # noqa: F401 - raw_write/resident_pages: used by the tests
    QDS,
    RAW_REQUEST,
    aligned_bytes,
    disk_counters,
    files_under,
    flush_wave_kind,
    fsync_dir,
    make_cold,
    raw_read,
    raw_write,
    resident_pages,
)
from _util import aa_spread, interleaved_samples

MiB = 1 << 20
O_DIRECT = getattr(os, "O_DIRECT", 0)
TOKENS = 32768
TOKEN_CHUNK = 256
BF16 = torch.bfloat16
#: bf16 chunk shapes (LMCache's KV_2LTD layout: 2, layers, tokens, hidden) per size in MiB.
SHAPES = {4: (2, 8, 256, 512), 32: (2, 8, 256, 4096)}
#: chunks per disk operation, per size (128 MiB and 256 MiB per operation).
CHUNKS = {4: 32, 32: 8}
#: workload groups ``--parts`` selects from.
PARTS = ("token", "cpu", "lookups", "disk")


# =========================================================================== statistics
def med(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def halves_spread(samples: Sequence[float]) -> float:
    """A/A spread of one contender measured once per repetition: even reps vs odd reps."""
    if len(samples) < 2:
        return float("nan")
    return aa_spread(list(samples[0::2]), list(samples[1::2]))


def figure(samples: dict[str, list[float]], name: str, work: float = 1.0) -> dict[str, float]:
    """Median time and rate (``work`` / time) of contender ``name`` with its A/A spread.

    ``samples`` holds ``name`` (one sample per repetition; A/A = even vs odd) or
    ``name A`` and ``name B`` (the same contender registered twice)."""
    if f"{name} A" in samples:
        a, b = samples[f"{name} A"], samples[f"{name} B"]
        t, aa = med(a + b), aa_spread(a, b)
    else:
        t, aa = med(samples[name]), halves_spread(samples[name])
    return {"time": t, "rate": work / t, "aa": aa}


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge runs: per row, every run's ratios and figures, and the medians over runs.

    Each run is ``{"rows": [{"row", "unit", "ours", "others": {name: fig}, "ratios":
    {name: ratio}, "aa"}]}`` as :func:`make_row` builds them."""
    by_row: dict[str, list[dict[str, Any]]] = {}
    order: list[str] = []
    for run in runs:
        for row in run["rows"]:
            if row["row"] not in by_row:
                order.append(row["row"])
            by_row.setdefault(row["row"], []).append(row)
    out = []
    for name in order:
        rows = by_row[name]
        first = rows[0]
        ratio_names = list(first["ratios"])
        out.append(
            {
                "row": name,
                "unit": first["unit"],
                "ours": med([r["ours"] for r in rows if r["ours"] is not None])
                if any(r["ours"] is not None for r in rows)
                else None,
                "others": {
                    k: med([r["others"][k] for r in rows if r["others"].get(k) is not None])
                    if any(r["others"].get(k) is not None for r in rows)
                    else None
                    for k in first["others"]
                },
                "ratios": {
                    k: {
                        "runs": [r["ratios"].get(k) for r in rows],
                        "median": med([r["ratios"][k] for r in rows if r["ratios"].get(k)])
                        if any(r["ratios"].get(k) for r in rows)
                        else None,
                    }
                    for k in ratio_names
                },
                "aa": max(r["aa"] for r in rows),
            }
        )
    return out


def make_row(
    row: str,
    unit: str,
    ours: dict[str, float] | None,
    others: dict[str, dict[str, float] | None],
    ratios_vs: Sequence[str] | None = None,
) -> dict[str, Any]:
    """One table row of a run: rates in ``unit``; speed ratios of ours against each other
    contender (their time / ours); the largest A/A spread among the contenders."""
    ratios: dict[str, float | None] = {}
    for k in ratios_vs if ratios_vs is not None else list(others):
        o = others.get(k)
        ratios[k] = None if ours is None or o is None else o["time"] / ours["time"]
    spreads = [f["aa"] for f in [ours, *others.values()] if f is not None]
    return {
        "row": row,
        "unit": unit,
        "ours": None if ours is None else ours["rate"],
        "others": {k: None if f is None else f["rate"] for k, f in others.items()},
        "ratios": ratios,
        "aa": max((s for s in spreads if s == s), default=float("nan")),
    }


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "rejected" if unit == "Mtok/s" else "—"
    if unit == "us":
        return f"{v:,.1f} µs"
    return f"{v:,.2f} {unit}" if v < 100 else f"{v:,.0f} {unit}"


def render(summary: Sequence[dict[str, Any]]) -> str:
    """The summary as a Markdown table: figures (medians over runs) and ratios per run."""
    lines = [
        "| path | lmcache-core | other | speed ratio per run (median) | max A/A |",
        "|---|---|---|---|---|",
    ]
    for r in summary:
        others = "; ".join(f"{k}: {_fmt(v, r['unit'])}" for k, v in r["others"].items())
        ratios = "; ".join(
            f"vs {k}: "
            + " / ".join("—" if x is None else f"{x:.2f}" for x in v["runs"])
            + ("" if v["median"] is None else f" (**{v['median']:.2f}x**)")
            for k, v in r["ratios"].items()
        )
        lines.append(
            f"| {r['row']} | {_fmt(r['ours'], r['unit'])} | {others} | {ratios} | {r['aa']:.2f} |"
        )
    return "\n".join(lines)


# =========================================================================== contenders
def lmcache_available() -> bool:
    try:
        import lmcache.v1.storage_backend.local_disk_backend  # noqa: F401
    except Exception:
        return False
    return True


def _quiet_lmcache_logs() -> None:
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).setLevel(logging.ERROR)


class Peer:
    """LMCache 0.5.6's local CPU backend and, optionally, its local disk backend."""

    def __init__(self, cpu_gib: float, disk_dir: str | None = None, odirect: bool = False):
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        _quiet_lmcache_logs()
        extra = {"use_odirect": True} if odirect else {}
        kw: dict[str, Any] = {
            "chunk_size": 256,
            "local_cpu": True,
            "max_local_cpu_size": cpu_gib,
            "extra_config": extra,
        }
        if disk_dir is not None:
            kw.update(local_disk=disk_dir, max_local_disk_size=64)
        self.config = LMCacheEngineConfig.from_defaults(**kw)
        _quiet_lmcache_logs()
        self.allocator = MixedMemoryAllocator(int(cpu_gib * 2**30))
        self.cpu = LocalCPUBackend(self.config, memory_allocator=self.allocator)
        from lmcache.v1.pin_monitor import PinMonitor

        PinMonitor.GetOrCreate(self.config)  # what its engine sets up before any pin
        self.disk: Any = None
        self.loop: Any = None
        if disk_dir is not None:
            import asyncio

            from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

            self.dir = disk_dir
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self._thread.start()
            self.disk = LocalDiskBackend(self.config, self.loop, self.cpu)
        _quiet_lmcache_logs()

    @staticmethod
    def key(i: int, dtype: torch.dtype = BF16) -> Any:
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey("peer", 1, 0, i, dtype)

    # -- cpu tier
    def cpu_put(self, key: Any, value: torch.Tensor) -> None:
        from lmcache.v1.memory_management import MemoryFormat

        obj = self.cpu.allocate(value.shape, value.dtype, MemoryFormat.KV_2LTD)
        obj.tensor.copy_(value)
        self.cpu.submit_put_task(key, obj)
        obj.ref_count_down()

    def cpu_get_into(self, key: Any, out: torch.Tensor) -> bool:
        obj = self.cpu.get_blocking(key)
        if obj is None:
            return False
        out.copy_(obj.tensor)
        obj.ref_count_down()
        return True

    # -- disk tier
    def disk_put_durable(self, keys: Sequence[Any], values: Sequence[torch.Tensor]) -> None:
        """Its put + waiting for its background writes + fsync of each file and the dir."""
        from lmcache.v1.memory_management import MemoryFormat

        done = threading.Semaphore(0)
        objs = []
        for v in values:
            obj = self.cpu.allocate(v.shape, v.dtype, MemoryFormat.KV_2LTD)
            obj.tensor.copy_(v)
            objs.append(obj)
        self.disk.batched_submit_put_task(keys, objs, on_complete_callback=lambda k: done.release())
        for obj in objs:
            obj.ref_count_down()
        for _ in keys:
            if not done.acquire(timeout=120):
                raise TimeoutError("LMCache's background disk writes did not finish")
        for k in keys:
            fd = os.open(self.disk._key_to_path(k), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(self.dir)

    def disk_read_into(self, keys: Sequence[Any], outs: Sequence[torch.Tensor]) -> None:
        objs = self.disk.batched_get_blocking(list(keys))
        for obj, out in zip(objs, outs, strict=True):
            if obj is None:
                raise RuntimeError("LMCache missed a chunk it stored")
            out.copy_(obj.tensor)
            obj.ref_count_down()

    def disk_paths(self, keys: Sequence[Any]) -> list[str]:
        return [self.disk._key_to_path(k) for k in keys]

    def disk_remove(self, keys: Sequence[Any]) -> None:
        for k in keys:
            self.disk.remove(k)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.allocator.close()


# =========================================================================== workloads
def bench_token_db(reps: int) -> list[dict[str, Any]]:
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import ChunkedTokenDatabase as PeerDB

    from lmcache_core import ChunkedTokenDatabase

    ours = ChunkedTokenDatabase(chunk_size=TOKEN_CHUNK, model_name="peer")
    meta = LMCacheMetadata(
        model_name="peer",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=BF16,
        kv_shape=(8, 2, 256, 4, 64),
    )
    theirs = PeerDB(None, meta)
    _quiet_lmcache_logs()
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 128_000, TOKENS, dtype=np.int64)
    inputs = {"list": arr.tolist(), "torch": torch.from_numpy(arr.copy()), "numpy": arr}
    assert len(list(ours.process_tokens(inputs["list"]))) == TOKENS // TOKEN_CHUNK
    rows = []
    for kind, tokens in inputs.items():
        fns: dict[str, Callable[[], object]] = {
            "ours A": partial(_listed, ours.process_tokens, tokens),
            "ours B": partial(_listed, ours.process_tokens, tokens),
        }
        try:
            got = list(theirs.process_tokens(tokens=tokens))
            accepted = len(got) == TOKENS // TOKEN_CHUNK
        except Exception:
            accepted = False
        if accepted:
            fns["LMCache A"] = partial(_listed, theirs.process_tokens, tokens=tokens)
            fns["LMCache B"] = partial(_listed, theirs.process_tokens, tokens=tokens)
        s = interleaved_samples(fns, rounds=reps, block=3)
        mtok = TOKENS / 1e6
        o = figure(s, "ours", mtok)
        t = figure(s, "LMCache", mtok) if accepted else None
        rows.append(make_row(f"token DB, {kind} input", "Mtok/s", o, {"LMCache": t}))
    return rows


def _timed_in_thread(fns: dict[str, Callable[[], object]], reps: int, block: int) -> Any:
    """interleaved_samples run in a fresh plain thread (ours is called as vLLM's threads do)."""
    box: list[Any] = []

    def body() -> None:
        try:
            box.append(interleaved_samples(fns, reps, block))
        except BaseException as exc:
            box.append(exc)

    th = threading.Thread(target=body)
    th.start()
    th.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _listed(fn: Callable[..., Any], *a: Any, **kw: Any) -> list[Any]:
    """``list(fn(*a, **kw))``: a token database's chunks, all made."""
    return list(fn(*a, **kw))


def bench_cpu(reps: int) -> list[dict[str, Any]]:
    from lmcache_core import CacheEngineKey, CPUBackend, SyncBackend, TieredHierarchy

    shape, nbytes, cap = SHAPES[4], 4 * MiB, 64
    value = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(BF16).view(shape)
    cpu = CPUBackend({"max_bytes": cap * nbytes})
    ours = SyncBackend(cpu)
    ours.start()
    peer = Peer(cap * nbytes / 2**30 + 0.01)
    okeys = [CacheEngineKey("peer", 1, 0, i + 1, "bfloat16") for i in range(cap)]
    pkeys = [Peer.key(i + 1) for i in range(cap)]
    for i in range(cap):
        assert ours.put(okeys[i], value)
        peer.cpu_put(pkeys[i], value)
    counter = [cap]

    def our_put() -> None:
        counter[0] += 1
        assert ours.put(CacheEngineKey("peer", 1, 0, counter[0], "bfloat16"), value)

    def peer_put() -> None:
        counter[0] += 1
        peer.cpu_put(Peer.key(counter[0]), value)

    rows = []
    s = _timed_in_thread(
        {"ours A": our_put, "LMCache A": peer_put, "ours B": our_put, "LMCache B": peer_put},
        reps,
        10,
    )
    rows.append(
        make_row(
            "cpu tier put 4 MiB (full tier: each put evicts)",
            "GB/s",
            figure(s, "ours", nbytes / 1e9),
            {"LMCache": figure(s, "LMCache", nbytes / 1e9)},
        )
    )
    # what is stored now: the last `cap` keys of each (same order, same values)
    okeys = list(cpu.keys())
    pkeys = list(peer.cpu.get_keys())
    assert len(okeys) >= 32 and len(pkeys) >= 32
    out_o, out_p = torch.empty(shape, dtype=BF16), torch.empty(shape, dtype=BF16)
    ig = [0, 0]

    def our_get() -> None:
        ig[0] += 1
        assert ours.get_into(okeys[ig[0] % 32], out_o)

    def peer_get() -> None:
        ig[1] += 1
        assert peer.cpu_get_into(pkeys[ig[1] % 32], out_p)

    s = _timed_in_thread(
        {"ours A": our_get, "LMCache A": peer_get, "ours B": our_get, "LMCache B": peer_get},
        reps,
        10,
    )
    assert torch.equal(out_o.view(torch.uint8), value.view(torch.uint8))
    assert torch.equal(out_p.view(torch.uint8), value.view(torch.uint8))
    rows.append(
        make_row(
            "cpu tier get 4 MiB into a caller buffer (32 chunks in turn)",
            "GB/s",
            figure(s, "ours", nbytes / 1e9),
            {"LMCache": figure(s, "LMCache", nbytes / 1e9)},
        )
    )
    ours.close()
    peer.close()

    # lookups: 128 present small chunks
    small = torch.zeros((2, 1, 16, 64), dtype=BF16)
    h = TieredHierarchy.from_config(
        {"tiers": [{"name": "cpu", "backend": "cpu", "options": {"max_bytes": "64MiB"}}]}
    )
    hs = SyncBackend(h)
    hs.start()
    peer = Peer(0.1)
    okeys = [CacheEngineKey("peer", 1, 0, 10_000 + i, "bfloat16") for i in range(128)]
    pkeys = [Peer.key(10_000 + i) for i in range(128)]
    for ok, pk in zip(okeys, pkeys, strict=True):
        assert hs.put(ok, small)
        peer.cpu_put(pk, small)

    def ours_bc() -> None:
        assert hs.batched_contains(okeys)[-1]

    def peer_bc() -> None:
        assert peer.cpu.batched_contains(pkeys) == 128

    s = _timed_in_thread(
        {"ours A": ours_bc, "LMCache A": peer_bc, "ours B": ours_bc, "LMCache B": peer_bc}, reps, 20
    )
    rows.append(_us_row("cpu tier batched_contains, 128 present keys", s))
    s = _timed_in_thread(
        {
            "ours A": lambda: hs.contains(okeys[7]),
            "LMCache A": lambda: peer.cpu.contains(pkeys[7]),
            "ours B": lambda: hs.contains(okeys[7]),
            "LMCache B": lambda: peer.cpu.contains(pkeys[7]),
        },
        reps,
        50,
    )
    rows.append(_us_row("cpu tier contains, one key", s))

    def ours_lease() -> None:
        assert hs.lookup_prefix(okeys, lease_s=30).leased == 128
        assert hs.release(okeys) == 128

    def peer_lease() -> None:
        assert peer.cpu.batched_contains(pkeys, pin=True) == 128
        for k in pkeys:
            peer.cpu.unpin(k)
        peer.cpu.keys_in_request = []  # what its touch_cache would consume

    s = _timed_in_thread(
        {
            "ours A": ours_lease,
            "LMCache A": peer_lease,
            "ours B": ours_lease,
            "LMCache B": peer_lease,
        },
        reps,
        10,
    )
    rows.append(_us_row("cpu tier lookup of 128 keys pinning the hits, then unpin", s))
    hs.close()
    peer.close()
    return rows


def _us_row(name: str, s: dict[str, list[float]]) -> dict[str, Any]:
    """A latency row (µs; the 'rate' field carries the time so lower is better)."""
    o, t = figure(s, "ours"), figure(s, "LMCache")
    row = make_row(name, "us", o, {"LMCache": t})
    row["ours"] = o["time"] * 1e6
    row["others"] = {"LMCache": t["time"] * 1e6}
    return row


def bench_disk_lookups(work: str, reps: int) -> list[dict[str, Any]]:
    from lmcache_backend_disk import DiskBackend

    from lmcache_core import CacheEngineKey, Namespace, SyncBackend, TieredHierarchy

    ns = Namespace(model_name="peer")
    small = torch.zeros((2, 1, 256, 64), dtype=BF16)  # 64 KiB
    disk = SyncBackend(
        DiskBackend({"path": os.path.join(work, "ours-lookup"), "max_bytes": "1GiB"}, namespace=ns)
    )
    disk.start()
    okeys = [CacheEngineKey("peer", 1, 0, 20_000 + i, "bfloat16") for i in range(128)]
    assert all(disk.batched_put(okeys, [small] * 128))
    h = TieredHierarchy.from_config(
        {
            "tiers": [
                {
                    "name": "disk",
                    "backend": "disk",
                    "options": {"path": os.path.join(work, "ours-lookup"), "max_bytes": "1GiB"},
                }
            ]
        },
        namespace=ns,
    )
    hs = SyncBackend(h)
    hs.start()
    peer = Peer(0.1, os.path.join(work, "peer-lookup"))
    pkeys = [Peer.key(20_000 + i) for i in range(128)]
    peer.disk_put_durable(pkeys, [small] * 128)

    def ours_bc() -> None:
        assert all(disk.batched_contains(okeys))

    def ours_lp() -> None:
        assert hs.lookup_prefix(okeys).num_hit == 128

    def peer_bc() -> None:
        assert peer.disk.batched_contains(pkeys) == 128

    s = _timed_in_thread(
        {"ours A": ours_bc, "LMCache A": peer_bc, "ours B": ours_bc, "LMCache B": peer_bc}, reps, 5
    )
    rows = [_us_row("disk tier batched_contains, 128 present keys", s)]
    s = _timed_in_thread(
        {"ours A": ours_lp, "LMCache A": peer_bc, "ours B": ours_lp, "LMCache B": peer_bc}, reps, 5
    )
    rows.append(
        _us_row("disk tier lookup_prefix (hierarchy) vs LMCache batched_contains, 128 keys", s)
    )
    hs.close()
    disk.close()
    peer.close()
    return rows


class DiskSize:
    """Durable puts and cold reads of one chunk size, all contenders, ``reps`` rounds."""

    def __init__(self, work: str, mib: int, io_nice: int = 0) -> None:
        from lmcache_backend_disk import DiskBackend, aligned_empty

        from lmcache_core import Namespace, SyncBackend

        self.mib, self.nbytes, self.n = mib, mib * MiB, CHUNKS[mib]
        self.shape = SHAPES[mib]
        self.work = os.path.join(work, f"{mib}mib")
        os.makedirs(self.work)
        g = torch.Generator().manual_seed(mib)
        self.values = [
            torch.randint(0, 256, (self.nbytes,), dtype=torch.uint8, generator=g)
            .view(BF16)
            .view(self.shape)
            for _ in range(self.n)
        ]
        self.raw_src = [aligned_bytes(self.nbytes) for _ in range(self.n)]
        for buf, v in zip(self.raw_src, self.values, strict=True):
            buf[:] = v.view(torch.uint8).reshape(-1).numpy().tobytes()
        self.raw_dst = [aligned_bytes(self.nbytes) for _ in range(self.n)]
        area = aligned_empty((self.n * self.nbytes,), torch.uint8)
        self.outs = {
            "aligned": [aligned_empty(self.shape, BF16) for _ in range(self.n)],
            "plain": [torch.empty(self.shape, dtype=BF16) for _ in range(self.n)],
            "view": [
                area[i * self.nbytes : (i + 1) * self.nbytes].view(BF16).view(self.shape)
                for i in range(self.n)
            ],
        }
        for outs in self.outs.values():
            for o in outs:
                o.view(torch.uint8).fill_(0)  # fault the pages in: reused caller buffers
        self.ours_dir = os.path.join(self.work, "ours")
        self.disk = DiskBackend(
            # io_nice: the raw baseline's and LMCache's threads run at the process's
            # priority; the tier's default (10) yields the CPU to serving threads
            {"path": self.ours_dir, "max_bytes": 8 * self.n * self.nbytes, "io_nice": io_nice},
            namespace=Namespace(model_name="peer"),
        )
        self.ours = SyncBackend(self.disk)
        self.ours.start()
        self.direct_io = bool(self.disk.direct_io)
        cpu_gib = 3 * self.n * self.nbytes / 2**30
        self.peers = {
            "LMCache buffered": Peer(cpu_gib, os.path.join(self.work, "peer-buffered")),
            "LMCache O_DIRECT": Peer(cpu_gib, os.path.join(self.work, "peer-odirect"), True),
        }
        self.samples: dict[str, list[float]] = {}
        #: device requests per object of each timed contender (``/proc/diskstats``)
        self.requests: dict[str, list[float]] = {}
        #: raw baseline variants: (name, requests in flight, request size); whole-file
        #: requests too when a chunk is larger than RAW_REQUEST
        reqs = [RAW_REQUEST] + ([self.nbytes] if self.nbytes > RAW_REQUEST else [])
        self.raw_variants = [
            (f"qd{qd}" + ("" if req == RAW_REQUEST else f" {req // MiB}MiB-requests"), qd, req)
            for req in reqs
            for qd in QDS
        ]

    def close(self) -> None:
        self.ours.close()
        for p in self.peers.values():
            p.close()
        shutil.rmtree(self.work, ignore_errors=True)

    def _object_files(self) -> list[str]:
        return files_under(self.ours_dir, self.nbytes)

    def _time(self, name: str, fn: Callable[[], object], cold: Sequence[str] = ()) -> None:
        """Time one contender; before a cold read its files leave the page cache (checked).
        Every put is durable when it returns, so none leaves writeback for the next."""
        if cold:
            make_cold(cold)
        c0 = disk_counters(self.work)
        t0 = time.perf_counter()
        fn()
        self.samples.setdefault(name, []).append(time.perf_counter() - t0)
        c1 = disk_counters(self.work)
        if c0 is not None and c1 is not None:  # reads completed, or writes completed
            i = 0 if cold else 4
            self.requests.setdefault(name, []).append((c1[i] - c0[i]) / self.n)

    def _check(self, outs: Sequence[torch.Tensor], what: str) -> None:
        for o, v in zip(outs, self.values, strict=True):
            if not torch.equal(o.view(torch.uint8), v.view(torch.uint8)):
                raise AssertionError(f"{what}: a read was not bit-exact")
            o.view(torch.uint8).fill_(0)

    def _check_raw(self) -> None:
        for got, want in zip(self.raw_dst, self.raw_src, strict=True):
            if not np.array_equal(np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)):
                raise AssertionError("raw read was not bit-exact")

    def repeat(self, r: int) -> None:
        from lmcache_core import CacheEngineKey

        base = 1_000_000 * (r + 1) + 1000 * self.mib
        okeys = [CacheEngineKey("peer", 1, 0, base + i, "bfloat16") for i in range(self.n)]
        pkeys = [Peer.key(base + i) for i in range(self.n)]
        names = [f"r{r}-{i}" for i in range(self.n)]
        raw_paths: dict[str, list[str]] = {}

        def put_raw(v: str, qd: int, req: int) -> None:
            d = os.path.join(self.work, f"raw-{v}")
            raw_paths[v] = raw_write(d, names, self.raw_src, qd, req)

        def read_raw(v: str, qd: int, req: int) -> None:
            raw_read(raw_paths[v], self.raw_dst, qd, req)

        puts: list[tuple[str, Callable[[], object]]] = [
            (f"raw put {v}", partial(put_raw, v, qd, req)) for v, qd, req in self.raw_variants
        ]
        puts.append(("ours put", lambda: self._ours_put(okeys)))
        for pname, peer in self.peers.items():
            puts.append((f"{pname} put", partial(peer.disk_put_durable, pkeys, self.values)))
        k = r % len(puts)
        for name, fn in puts[k:] + puts[:k]:
            self._time(name, fn)
        reads: list[tuple[str, Callable[[], object], Callable[[], list[str]], Callable[[], None]]]
        reads = [
            (
                f"raw read {v}",
                partial(read_raw, v, qd, req),
                partial(raw_paths.__getitem__, v),
                self._check_raw,
            )
            for v, qd, req in self.raw_variants
        ]
        for kind, outs in self.outs.items():
            reads.append(
                (
                    f"ours read {kind}",
                    partial(self._ours_read, okeys, outs),
                    self._object_files,
                    partial(self._check, outs, f"ours {kind}"),
                )
            )
        for pname, peer in self.peers.items():
            outs = self.outs["plain"]
            reads.append(
                (
                    f"{pname} read",
                    partial(peer.disk_read_into, pkeys, outs),
                    partial(peer.disk_paths, pkeys),
                    partial(self._check, outs, pname),
                )
            )
        k = r % len(reads)
        for name, fn, files, check in reads[k:] + reads[:k]:
            self._time(name, fn, files())
            check()
        # untimed clean-up: every contender starts the next round with an empty tier
        assert all(self.ours.batched_contains(okeys))
        for kk in okeys:
            self.ours.remove(kk)
        for peer in self.peers.values():
            peer.disk_remove(pkeys)
        for v, _, _ in self.raw_variants:
            shutil.rmtree(os.path.join(self.work, f"raw-{v}"), ignore_errors=True)

    def _ours_put(self, keys: Sequence[Any]) -> None:
        if not all(self.ours.batched_put(keys, self.values)):
            raise RuntimeError("lmcache-core refused a put")

    def _ours_read(self, keys: Sequence[Any], outs: Sequence[torch.Tensor]) -> None:
        if not all(self.ours.batched_get_into(keys, outs)):
            raise RuntimeError("lmcache-core missed a chunk it stored")

    def rows(self) -> list[dict[str, Any]]:
        s, total = self.samples, self.n * self.nbytes / 1e9
        fig = {k: figure(s, k, total) for k in s}
        raw_put = min(
            (fig[f"raw put {v}"] for v, _, _ in self.raw_variants), key=lambda f: f["time"]
        )
        raw_read_ = min(
            (fig[f"raw read {v}"] for v, _, _ in self.raw_variants), key=lambda f: f["time"]
        )
        size = f"{self.mib} MiB"
        rows = [
            make_row(
                f"durable put {size}",
                "GB/s",
                fig["ours put"],
                {
                    "LMCache buffered": fig["LMCache buffered put"],
                    "LMCache O_DIRECT": fig["LMCache O_DIRECT put"],
                    "raw": raw_put,
                },
            )
        ]
        for kind in self.outs:
            rows.append(
                make_row(
                    f"cold read {size} into {kind} buffers",
                    "GB/s",
                    fig[f"ours read {kind}"],
                    {
                        "LMCache buffered": fig["LMCache buffered read"],
                        "LMCache O_DIRECT": fig["LMCache O_DIRECT read"],
                        "raw": raw_read_,
                    },
                )
            )
        detail = ", ".join(f"{k} {v['rate']:.2f}" for k, v in sorted(fig.items()))
        print(f"  {size} x {self.n}: GB/s medians: {detail}", flush=True)
        if self.requests:  # the device's view: a transfer split into more requests costs
            reqs = ", ".join(f"{k} {med(v):.1f}" for k, v in sorted(self.requests.items()))
            staged = self.ours.stats().get("small_page_stagings", "n/a")
            print(
                f"  {size} x {self.n}: device requests per object: {reqs}; aligned caller "
                f"tensors in 4 KiB pages the tier staged: {staged}",
                flush=True,
            )
        return rows


# =========================================================================== one run
def one_run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    load0 = os.getloadavg()
    work = tempfile.mkdtemp(prefix="bench-peer-", dir=args.dir)
    rows: list[dict[str, Any]] = []
    try:
        t0 = time.perf_counter()
        if "token" in args.parts:
            rows += bench_token_db(args.reps)
        if "cpu" in args.parts:
            from lmcache_core.memory import shared_copy_stats

            kind, helped, stalls = shared_copy_stats()
            rows += bench_cpu(args.reps)
            _, helped2, stalls2 = shared_copy_stats()
            print(
                f"  cpu tier: {kind} copy helper took part in {helped2 - helped} copies, "
                f"{stalls2 - stalls} stalls (each pauses sharing)",
                flush=True,
            )
        if "lookups" in args.parts:
            rows += bench_disk_lookups(work, args.reps)
        print(f"  token DB, cpu tier, lookups: {time.perf_counter() - t0:.0f} s", flush=True)
        for mib in args.mib if "disk" in args.parts else []:
            size = DiskSize(work, mib, args.io_nice)
            if not size.direct_io:
                print(f"  warning: {work} refuses O_DIRECT; lmcache-core reads buffered")
            try:
                t0 = time.perf_counter()
                for r in range(args.reps):
                    size.repeat(r)
                print(f"  disk {mib} MiB: {time.perf_counter() - t0:.0f} s", flush=True)
                rows += size.rows()
            finally:
                size.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "rows": rows,
        "load_before": load0,
        "load_after": os.getloadavg(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _read_queue() -> str:
    """Which read queue the disk tier uses here (``LMCACHE_CORE_READ_QUEUE``)."""
    try:
        from lmcache_core.turns import ReadTurns
    except ImportError:  # older versions: a semaphore in the disk backend
        return "python semaphore"
    return "compiled" if ReadTurns(1).native else "python semaphore"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="processes, one after the other")
    ap.add_argument("--reps", type=int, default=7, help="repetitions per run (>= 7)")
    ap.add_argument(
        "--mib",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[4, 32],
        help="disk chunk sizes in MiB (4,32)",
    )
    ap.add_argument(
        "--io-nice",
        type=int,
        default=0,
        help="the disk tier's io_nice (default 0: the priority of the other contenders' "
        "threads; the tier's own default is 10)",
    )
    ap.add_argument(
        "--parts",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(PARTS),
        help=f"which workloads ({','.join(PARTS)}; default all)",
    )
    ap.add_argument("--dir", default=None, help="where the disk tiers live (default: temp dir)")
    ap.add_argument("--one-run", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    args = ap.parse_args()
    if not lmcache_available():
        sys.exit(
            "LMCache 0.5.6 is not importable here: run `make bench-peer` (it builds "
            ".venv-peer with it) or use .venv-peer/bin/python"
        )
    if args.one_run:
        Path(args.one_run).write_text(json.dumps(one_run(args)))
        return
    import lmcache

    print(
        f"lmcache-core vs LMCache {getattr(lmcache, '__version__', '?')}, torch "
        f"{torch.__version__}, {os.cpu_count()} cores, {args.runs} runs x {args.reps} reps, "
        f"disk sizes {args.mib} MiB, disk read queue: {_read_queue()}, "
        f"flushes: {flush_wave_kind()}",
        flush=True,
    )
    runs = []
    for i in range(args.runs):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            print(f"run {i + 1}/{args.runs} (load average {os.getloadavg()[0]:.1f})", flush=True)
            cmd = [
                sys.executable,
                __file__,
                "--one-run",
                f.name,
                "--reps",
                str(args.reps),
                "--mib",
                ",".join(map(str, args.mib)),
                "--parts",
                ",".join(args.parts),
                "--io-nice",
                str(args.io_nice),
            ] + (["--dir", args.dir] if args.dir else [])
            subprocess.run(cmd, check=True)
            run = json.loads(Path(f.name).read_text())
        runs.append(run)
        for row in run["rows"]:
            ratios = ", ".join(f"vs {k} {v:.2f}x" for k, v in row["ratios"].items() if v)
            print(
                f"  {row['row']}: ours {_fmt(row['ours'], row['unit'])}; {ratios} "
                f"(A/A {row['aa']:.2f})",
                flush=True,
            )
    summary = summarize(runs)
    loads = [f"{r['load_before'][0]:.1f}->{r['load_after'][0]:.1f}" for r in runs]
    print(f"\nload average per run: {', '.join(loads)}\n")
    print(render(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
