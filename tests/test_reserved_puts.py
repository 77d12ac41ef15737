"""Reserved puts (``ReservedPuts``): a chunk written once, into memory the cpu tier keeps,
and written through to a real disk tier from that same memory.

What must hold: a reservation is visible under no key until its commit; an abort leaves
nothing visible and recycles the memory; a commit borrowed for a write-through keeps the
memory from eviction, recycling and in-place overwrites until the lower tier's store
ended (the disk tier's files then hold the committed bytes, whatever the cpu tier did
meanwhile); a save whose gather failed is aborted.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_core import ChunkedTokenDatabase, CPUBackend, Namespace, TieredHierarchy, load_config
from lmcache_core.interface import ReservedPuts, check_backend_class, implements
from lmcache_core.keys import CacheEngineKey
from lmcache_core.testing import random_tensor, run_async, same_bits

pytest.importorskip("lmcache_backend_disk", reason="lmcache-backend-disk is not installed")
from lmcache_backend_disk.backend import DiskBackend

SHAPE = (256, 1024)  # 1 MiB of float32
MIB = 1 << 20
NS = Namespace(model_name="reserved", chunk_size=256, block_size=16)
DB = ChunkedTokenDatabase(namespace=NS)
_NAMES: dict[str, int] = {}


def make_key(name: str) -> CacheEngineKey:
    """A key of this test's namespace (the disk tier serves its own namespace's keys)."""
    return DB.make_key(_NAMES.setdefault(name, len(_NAMES) + 1))


def val(seed: int) -> torch.Tensor:
    return random_tensor(SHAPE, torch.float32, seed=seed)


def reserve(b: Any, fresh: bool = True) -> tuple[object, torch.Tensor]:
    res = b.try_reserve_threadsafe(torch.float32, SHAPE, fresh)
    assert res is not None
    return res  # type: ignore[no-any-return]


def test_cpu_backend_declares_reserved_puts() -> None:
    check = check_backend_class(CPUBackend)
    assert check.problems == [] and "ReservedPuts" in check.optional
    assert implements(CPUBackend(), ReservedPuts)


def test_a_reservation_is_invisible_until_committed_and_ends_once() -> None:
    async def run() -> None:
        async with CPUBackend({"max_bytes": "8MiB"}) as b:
            # No recycled memory yet: a reservation that must not fault in new pages fails.
            assert b.try_reserve_threadsafe(torch.float32, SHAPE, False) is None
            h, view = reserve(b)
            view.copy_(val(1))
            k = make_key("a")
            assert not await b.contains(k) and b.keys() == [] and await b.get(k) is None
            assert b.stats()["reservations"] == 1
            assert b.commit_reserved(h, k) == (True, None)
            assert same_bits(await b.get(k), val(1))
            # It ended: a second commit or an abort does nothing.
            assert b.commit_reserved(h, make_key("b")) == (False, None)
            b.abort_reserved(h)
            assert not await b.contains(make_key("b")) and same_bits(await b.get(k), val(1))
            s = b.stats()
            assert (s["reservations"], s["reservations_committed"]) == (0, 1)
            assert s["used_bytes"] == b.entry_cost(MIB)

    run_async(run())


def test_an_abort_leaves_nothing_visible_and_recycles_the_memory() -> None:
    async def run() -> None:
        async with CPUBackend({"max_bytes": "8MiB"}) as b:
            h, view = reserve(b)
            view.fill_(7.0)
            ptr = view.data_ptr()
            b.abort_reserved(h)
            assert b.keys() == [] and b.stats()["used_bytes"] == 0
            assert b.commit_reserved(h, make_key("x")) == (False, None)
            assert b.keys() == []
            # The aborted memory (already faulted in) is what the next reservation gets.
            h2, view2 = reserve(b, fresh=False)
            assert view2.data_ptr() == ptr
            b.abort_reserved(h2)
            assert b.stats()["reservations_aborted"] == 2

    run_async(run())


def test_reservations_count_against_capacity_and_recycle_evicted_memory() -> None:
    async def run() -> None:
        async with CPUBackend({"max_bytes": "8MiB"}) as b:
            cap = 8 * MIB // b.entry_cost(MIB)
            keys = [make_key(f"k{i}") for i in range(cap)]
            for i, k in enumerate(keys):
                assert await b.put(k, val(i))
            # Full: a reservation evicts the least recently used entry and takes its memory.
            h, view = reserve(b, fresh=False)
            assert b.keys() == keys[1:]
            view.copy_(val(99))
            assert b.commit_reserved(h, keys[0]) == (True, None)
            assert same_bits(await b.get(keys[0]), val(99))
            for i, k in enumerate(keys[1:], start=1):
                assert same_bits(await b.get(k), val(i))
            # Everything pinned: no room, no reservation.
            handles = b.pin_many(b.keys())
            assert b.try_reserve_threadsafe(torch.float32, SHAPE) is None
            b.unpin_many(handles)

    run_async(run())


def test_a_commit_after_close_stores_nothing() -> None:
    async def run() -> None:
        b = CPUBackend({"max_bytes": "8MiB"})
        await b.start()
        h, _ = reserve(b)
        await b.close()
        assert b.commit_reserved(h, make_key("late")) == (False, None)
        b.abort_reserved(h)  # no-op

    run_async(run())


def test_a_borrowed_commit_keeps_its_memory_until_the_borrow_ends() -> None:
    async def run() -> None:
        async with CPUBackend({"max_bytes": "8MiB"}) as b:
            h, view = reserve(b)
            view.copy_(val(5))
            k = make_key("w")
            ok, borrow = b.commit_reserved(h, k, borrow=True)
            assert ok and borrow is not None
            # Overwritten and removed explicitly, then the tier churns through new values:
            # the borrowed memory is neither reused nor overwritten in place.
            assert await b.put(k, val(6))
            assert await b.remove(k)
            for i in range(20):
                assert await b.put(make_key(f"c{i}"), val(100 + i))
                h2, v2 = reserve(b)
                assert v2.data_ptr() != view.data_ptr()
                v2.fill_(-1.0)
                b.abort_reserved(h2)
            assert same_bits(view, val(5))
            b.end_borrows([borrow])
            # Released: its memory is recycled now.
            seen = set()
            for i in range(8):
                assert await b.put(make_key(f"d{i}"), val(200 + i))
            for e in b._entries.values():
                seen.add(e.buf.data_ptr())
            assert view.data_ptr() in seen

    run_async(run())


class GatedDisk(DiskBackend):
    """The real disk backend whose stores wait for a gate (so a write-through is pending
    while the test works the cpu tier above)."""

    gate: asyncio.Event | None = None

    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        if self.gate is not None:
            await self.gate.wait()
        return await super()._put(key, value, donate)


def cpu_over_disk(root: Path, cpu_bytes: str = "8MiB") -> tuple[TieredHierarchy, GatedDisk]:
    cfg = load_config(
        {
            "chunk_size": 256,
            "tiers": [
                {"name": "cpu", "backend": "cpu", "options": {"max_bytes": cpu_bytes}},
                {"name": "disk", "backend": "disk", "options": {"path": str(root)}},
            ],
        }
    )
    disk = GatedDisk({"path": str(root)}, namespace=NS)
    cpu = CPUBackend({"max_bytes": cpu_bytes}, namespace=NS)
    return TieredHierarchy(cfg, backends=[cpu, disk], namespace=NS), disk


async def read_disk(root: Path, keys: list[CacheEngineKey]) -> list[torch.Tensor | None]:
    async with DiskBackend({"path": str(root)}, namespace=NS) as d:
        return [await d.get(k) for k in keys]


def test_write_through_reads_the_committed_memory_while_the_cpu_tier_churns(
    tmp_path: Path,
) -> None:
    root = tmp_path / "kv"
    keys = [make_key(f"r{i}") for i in range(3)]

    async def run() -> None:
        h, disk = cpu_over_disk(root)
        disk.gate = asyncio.Event()
        async with h:
            cpu = h.tiers[0].backend
            views = []
            for i, k in enumerate(keys):
                res = h.reserve_in_top_threadsafe(torch.float32, SHAPE)
                assert res is not None
                res.value.copy_(val(i))
                views.append(res.value)
                assert await h.put_reserved(k, res)
                assert not res.open
            assert h.tier("disk").writer.depth == 3  # written through from that memory
            assert all(h.tier("disk").writer.peek(k) is v for k, v in zip(keys, views, strict=True))
            # While the disk stores wait: overwrite, remove and evict in the cpu tier.
            assert await cpu.put(keys[0], val(50))
            assert await cpu.remove(keys[1])
            for i in range(20):
                assert await cpu.put(make_key(f"other{i}"), val(300 + i))
            for i, v in enumerate(views):
                assert same_bits(v, val(i))  # nobody wrote into the borrowed memory
            disk.gate.set()
            await h.flush()
            assert cpu.stats()["pinned_entries"] == 0
            # Borrows ended: the cpu tier's accounting is whole again.
            s = cpu.stats()
            assert s["used_bytes"] + s["recycled_bytes"] <= 8 * MIB

        got = await read_disk(root, keys)
        for i, g in enumerate(got):
            assert same_bits(g, val(i)), f"disk holds wrong bytes for chunk {i}"

    run_async(run())


def test_a_not_admitted_or_cancelled_reserved_put_stores_nothing_in_the_top_tier(
    tmp_path: Path,
) -> None:
    root = tmp_path / "kv"

    async def run() -> None:
        h, _ = cpu_over_disk(root)
        async with h:
            cpu = h.tiers[0].backend
            # Cancelled before it ran: the call never saw the reservation; the caller's
            # abort (a no-op had it ended) leaves nothing visible anywhere.
            res = h.reserve_in_top_threadsafe(torch.float32, SHAPE)
            assert res is not None
            res.value.copy_(val(1))
            task = asyncio.ensure_future(h.put_reserved(make_key("c"), res))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            res.abort()
            assert not res.open and cpu.stats()["reservations"] == 0
            # Not admitted by the top tier (a placement-free stand-in: admit_after): the
            # write-through gets a staged copy, the reservation is aborted.
            h.tiers[0].sightings = type(h.tiers[0].sightings)(2)
            res = h.reserve_in_top_threadsafe(torch.float32, SHAPE)
            assert res is not None
            res.value.copy_(val(2))
            assert not await h.put_reserved(make_key("n"), res)
            assert not res.open and cpu.stats()["reservations"] == 0
            assert make_key("n") not in list(cpu.keys())
            await h.flush()
            assert not await h.contains(make_key("c"))
            # An abort by the caller (a failed gather): nothing visible.
            res = h.reserve_in_top_threadsafe(torch.float32, SHAPE)
            assert res is not None
            res.abort()
            assert cpu.stats()["reservations"] == 0 and cpu.keys() == []
            await h.flush()
        c, n = await read_disk(root, [make_key("c"), make_key("n")])
        assert c is None and same_bits(n, val(2))

    run_async(run())


def test_the_hierarchy_lends_only_where_a_thread_may_evict(tmp_path: Path) -> None:
    async def run() -> None:
        cfg = {
            "tiers": [
                {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "8MiB"}},
                {"name": "disk", "backend": "disk", "write": {"policy": "back"},
                 "options": {"path": str(tmp_path / "kv")}},
            ]
        }  # fmt: skip
        async with TieredHierarchy.from_config(cfg) as h:
            # Evictions would hand values to write-back from the caller's thread: no.
            assert h.reserve_in_top_threadsafe(torch.float32, SHAPE) is None

    run_async(run())
