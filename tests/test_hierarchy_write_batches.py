"""Background stores waiting together go to a persistent tier as one batched put.

The write queue hands every store waiting when a worker wakes (up to ``max_batch``) to
``store_batch``; a lone store still goes to ``store``. A disk tier below a cpu tier then
gets the write-through of several chunks in one ``batched_put`` (one index transaction
and one flush wave per batch), each chunk counted on its own: stored, refused or failed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_core import TieredHierarchy
from lmcache_core.hierarchy.staging import StagedChunk
from lmcache_core.hierarchy.stats import TierStats
from lmcache_core.hierarchy.writer import WriteJob, WriteQueue
from lmcache_core.testing import make_key, random_tensor, run_async, same_bits


class _Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.single: list[str] = []
        self.batches: list[list[str]] = []
        self.fail = fail

    async def store(self, job: WriteJob) -> None:
        self.single.append(job.key.chunk_hash_hex)
        await asyncio.sleep(0)

    async def store_batch(self, jobs: list[WriteJob]) -> None:
        self.batches.append([j.key.chunk_hash_hex for j in jobs])
        await asyncio.sleep(0)
        if self.fail:
            raise RuntimeError("injected batch failure")


def _queue(rec: _Recorder, *, concurrency: int, max_batch: int, batched: bool = True) -> WriteQueue:
    return WriteQueue(
        rec.store,
        TierStats(),
        max_queue=64,
        max_latency_s=None,
        concurrency=concurrency,
        name="t",
        store_batch=rec.store_batch if batched else None,
        max_batch=max_batch,
    )


def _enqueue(q: WriteQueue, n: int, tag: str) -> tuple[list[StagedChunk], list[str]]:
    """``n`` stores queued; their chunks and key hashes (hex), in queue order."""
    chunks, names = [], []
    for i in range(n):
        chunk, key = StagedChunk(torch.zeros(4), None), make_key(f"{tag}{i}")
        q.enqueue(key, chunk, "through")
        chunks.append(chunk)
        names.append(key.chunk_hash_hex)
    return chunks, names


@pytest.mark.parametrize(
    ("n", "max_batch", "expected"),
    [(5, 16, [5]), (5, 2, [2, 2, 1]), (1, 16, [])],
)
def test_a_worker_takes_every_waiting_store_up_to_max_batch(
    n: int, max_batch: int, expected: list[int]
) -> None:
    rec = _Recorder()

    async def run() -> tuple[WriteQueue, list[str]]:
        q = _queue(rec, concurrency=1, max_batch=max_batch)
        _, names = _enqueue(q, n, "k")
        await q.flush()
        return q, names

    q, names = run_async(run())
    # (a batch of one goes to the single-store call)
    assert [len(b) for b in rec.batches if len(b) > 1] == [e for e in expected if e > 1]
    stored = [h for b in rec.batches for h in b] + rec.single
    assert sorted(stored) == sorted(names)
    # FIFO: the batches and single stores together keep the queue's order
    order = []
    for b in rec.batches:
        order += b
    if not rec.batches:
        order = rec.single
    assert order == names[: len(order)]
    assert q.completed == n and q.depth == 0 and q.pending == 0


def test_without_store_batch_every_store_runs_alone() -> None:
    rec = _Recorder()

    async def run() -> list[str]:
        q = _queue(rec, concurrency=1, max_batch=16, batched=False)
        _, names = _enqueue(q, 4, "s")
        await q.flush()
        return names

    names = run_async(run())
    assert rec.batches == [] and rec.single == names


def test_a_failed_batch_releases_every_chunk_and_the_worker_goes_on() -> None:
    rec = _Recorder(fail=True)

    async def run() -> tuple[WriteQueue, list[StagedChunk]]:
        q = _queue(rec, concurrency=1, max_batch=16)
        chunks, _ = _enqueue(q, 3, "f")
        await q.flush()
        rec.fail = False
        _enqueue(q, 2, "g")
        await q.flush()
        return q, chunks

    q, chunks = run_async(run())
    assert [len(b) for b in rec.batches] == [3, 2]
    assert all(c._refs == 1 for c in chunks)  # the queue released what it retained
    assert q.depth == 0 and q.completed == 2


def test_close_cancels_a_running_batch_as_that_many_stores() -> None:
    class Slow(_Recorder):
        gate: asyncio.Event

        async def store_batch(self, jobs: list[WriteJob]) -> None:
            self.batches.append([j.key.chunk_hash_hex for j in jobs])
            await self.gate.wait()

    rec = Slow()

    async def run() -> tuple[int, WriteQueue]:
        rec.gate = asyncio.Event()
        q = _queue(rec, concurrency=1, max_batch=16)
        _enqueue(q, 4, "c")
        for _ in range(5):
            await asyncio.sleep(0)
        lost = await q.close(timeout=0.05)
        return lost, q

    lost, q = run_async(run())
    assert [len(b) for b in rec.batches] == [4]
    assert lost == 4 and q.cancelled == 4 and q.depth == 0


# ---------------------------------------------------------------------------- a disk tier
pytest.importorskip("lmcache_backend_disk", reason="lmcache-backend-disk is not installed")


def _cpu_over_disk(root: Path) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "hot", "backend": "cpu", "options": {"max_bytes": "64MiB"}},
            {"name": "disk", "backend": "disk",
             "options": {"path": str(root), "max_bytes": "512MiB"}},
        ]
    }  # fmt: skip


def test_write_through_to_disk_goes_in_batches_and_every_chunk_lands(tmp_path: Path) -> None:
    keys = [make_key(f"w{i}") for i in range(12)]
    vals = [random_tensor((16 * 1024,), torch.float32, seed=i) for i in range(12)]
    calls: list[int] = []

    async def run() -> tuple[dict[str, Any], list[bool], list[torch.Tensor]]:
        async with TieredHierarchy.from_config(_cpu_over_disk(tmp_path / "kv")) as h:
            disk = h.tier("disk")
            real = disk.backend.batched_put

            async def spy(ks: Any, vs: Any, donate: bool = False) -> list[bool]:
                calls.append(len(ks))
                return list(await real(ks, vs, donate))

            disk.backend.batched_put = spy
            # stored together (one loop iteration): their write-through waits together
            assert (
                await asyncio.gather(*(h.put(k, v) for k, v in zip(keys, vals, strict=True)))
                == [True] * 12
            )
            await h.flush()
            stats = h.stats()["tiers"][1]
            found = await disk.backend.batched_contains(keys)
            outs = [torch.empty_like(v) for v in vals]
            got = await disk.backend.batched_get_into(keys, outs)
            assert got == [True] * 12
            return stats, found, outs

    stats, found, outs = run_async(run())
    assert found == [True] * 12
    assert all(same_bits(o, v) for o, v in zip(outs, vals, strict=True))
    assert sum(calls) == 12 and max(calls) > 1, calls  # batched, not one put per chunk
    assert stats["stores"] == 12 and stats["store_failures"] == 0


def test_a_refused_or_failed_batch_is_counted_per_chunk(tmp_path: Path) -> None:
    keys = [make_key(f"r{i}") for i in range(6)]
    vals = [random_tensor((4096,), torch.float32, seed=i) for i in range(6)]

    async def run() -> tuple[dict[str, Any], dict[str, Any], list[bool]]:
        async with TieredHierarchy.from_config(_cpu_over_disk(tmp_path / "kv")) as h:
            disk = h.tier("disk")
            real = disk.backend.batched_put

            async def refuse_odd(ks: Any, vs: Any, donate: bool = False) -> list[bool]:
                res = list(await real(ks, vs, donate))
                return [
                    ok and int(k.chunk_hash_hex, 16) % 2 == 0 for k, ok in zip(ks, res, strict=True)
                ]

            disk.backend.batched_put = refuse_odd
            await asyncio.gather(*(h.put(k, v) for k, v in zip(keys[:3], vals[:3], strict=True)))
            await h.flush()
            first = dict(h.stats()["tiers"][1])
            known = [k in disk.known for k in keys[:3]]

            async def boom(ks: Any, vs: Any, donate: bool = False) -> list[bool]:
                raise OSError("injected")

            disk.backend.batched_put = boom
            await asyncio.gather(*(h.put(k, v) for k, v in zip(keys[3:], vals[3:], strict=True)))
            await h.flush()
            return first, dict(h.stats()["tiers"][1]), known

    first, second, known = run_async(run())
    even = [int(k.chunk_hash_hex, 16) % 2 == 0 for k in keys[:3]]
    assert first["stores"] == sum(even) and first["store_failures"] == 3 - sum(even)
    assert known == even  # only stored chunks are known to the tier
    assert second["store_failures"] == first["store_failures"] + 3
    assert second["stores"] == first["stores"] and second["errors"] >= 1
