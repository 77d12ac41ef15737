"""A worker's saves into memory the cpu tier reserved (one copy per chunk), with the real
``cpu`` and ``disk`` backends and real files; no engine.

Once the cpu tier recycles memory, a save gathers its chunk straight into a reservation
of the tier, which then publishes that memory; the write-through to disk reads it too.
Checked: what lands in both tiers is the gathered blocks, bit for bit; a failed gather
leaves nothing visible and no reservation open; the copying path still serves a tier
with nothing to recycle.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from copy_checks import BLOCKS, caches, fill

from lmcache_core import ChunkedTokenDatabase, Namespace
from lmcache_core.config import load_config
from lmcache_core.integrations.vllm.layout import BlockCopier
from lmcache_core.integrations.vllm.saves import SaveItem, SaveQueue
from lmcache_core.integrations.vllm.staging import ChunkBuffers
from lmcache_core.integrations.vllm.storage import Storage

pytest.importorskip("lmcache_backend_disk", reason="lmcache-backend-disk is not installed")

NS = Namespace(model_name="m-res", chunk_size=32, block_size=16)
DB = ChunkedTokenDatabase(namespace=NS)


def _storage(root: Path, cpu_chunks: int, chunk_bytes: int) -> Storage:
    cfg = load_config(
        {
            "chunk_size": 32,
            "tiers": [
                {
                    "name": "cpu",
                    "backend": "cpu",
                    # room for cpu_chunks chunks (each charged ~1 KiB of overhead)
                    "options": {"max_bytes": cpu_chunks * (chunk_bytes + 4096)},
                },
                {"name": "disk", "backend": "disk", "options": {"path": str(root / "disk")}},
            ],
        }
    )
    return Storage(cfg, NS)


def _wait(pred: Any, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.fixture
def setup(tmp_path: Path) -> Any:
    views = caches("cpu", "LBHNC")
    fill(views, 11)
    copier = BlockCopier(views, BLOCKS)
    shape = copier.chunk_shape(2)
    chunk_bytes = copier.block_nbytes * 2
    storage = _storage(tmp_path, 4, chunk_bytes)
    q = SaveQueue(storage, ChunkBuffers(shape, torch.float32, 8), copier)
    yield storage, copier, q, tmp_path
    storage.close()


def _expected(copier: BlockCopier, blocks: list[int]) -> torch.Tensor:
    out = torch.empty(copier.chunk_shape(2))
    copier.gather(blocks, out)
    return out


def _save(storage: Storage, q: SaveQueue, items: list[SaveItem]) -> None:
    assert q.submit(items) == []
    _wait(lambda: q.pending == 0)
    storage.submit(storage.hierarchy.flush()).result(timeout=20)


def _items(first: int, n: int) -> list[SaveItem]:
    return [
        SaveItem(DB.make_key(h), h, f"r{h}", 0, [2 * (h % 8), 2 * (h % 8) + 1])
        for h in range(first, first + n)
    ]


def _disk_holds(storage: Storage, key: Any, want: torch.Tensor) -> bool:
    disk = storage.hierarchy.tiers[1]
    out = torch.empty_like(want)

    async def read() -> bool:
        return bool(await disk.backend.get_into(key, out))

    return storage.submit(read()).result(timeout=20) and torch.equal(out, want)


def test_saves_into_reserved_memory_land_bit_exact_in_both_tiers(setup: Any) -> None:
    storage, copier, q, _ = setup
    cpu = storage.hierarchy.tiers[0].backend
    # Filling the tier: no recycled memory yet, so the saves copy (page faults stay off
    # the engine thread).
    _save(storage, q, _items(0, 4))
    assert q.reserved == 0 and q.stored == 4
    # Full: each new save evicts an old chunk and gathers into its recycled memory (two
    # per step: a step cannot reserve more than the tier holds).
    items = _items(4, 6)
    for i in range(0, 6, 2):
        _save(storage, q, items[i : i + 2])
    assert q.reserved == 6 and q.stored == 10
    s = cpu.stats()
    assert (s["reservations_committed"], s["reservations"], s["reservations_aborted"]) == (6, 0, 0)
    assert s["pinned_entries"] == 0
    stored = {h for h, _, _ in q.take_stored()}
    assert stored == set(range(10))
    for it in items:
        want = _expected(copier, it.block_ids)
        out = torch.empty_like(want)
        if cpu.try_batched_get_into_threadsafe([it.key], [out]) == [True]:
            assert torch.equal(out, want)
        assert _disk_holds(storage, it.key, want), f"disk holds wrong bytes for {it.chunk_hash}"
    # The last ones are in the cpu tier, committed from the reservations.
    last = items[-1]
    out = torch.empty(copier.chunk_shape(2))
    assert storage.get_into_memory([last.key], [out]) == [True]
    assert torch.equal(out, _expected(copier, last.block_ids))


class _FailingCopier:
    """A copier whose gathers write half the chunk, then fail (an extra fake layer
    around the real one)."""

    def __init__(self, real: BlockCopier) -> None:
        self.real = real

    def gather_to_host(self, block_ids: list[int], buf: torch.Tensor, other: Any) -> Any:
        buf.view(-1)[: buf.numel() // 2].fill_(123.0)
        raise RuntimeError("gather failed")


def test_a_failed_gather_aborts_its_reservation_and_nothing_is_visible(setup: Any) -> None:
    storage, copier, q, _ = setup
    cpu = storage.hierarchy.tiers[0].backend
    _save(storage, q, _items(0, 5))  # full, recycling
    before = set(cpu.keys())
    q.copier = _FailingCopier(copier)  # type: ignore[assignment]
    bad = _items(100, 1)
    with pytest.raises(RuntimeError, match="gather failed"):
        q.submit(bad)
    q.copier = copier
    s = cpu.stats()
    assert s["reservations"] == 0 and s["reservations_aborted"] == 1
    assert q.pending == 0 and q.stored == 5
    storage.submit(storage.hierarchy.flush()).result(timeout=20)
    assert bad[0].key not in list(cpu.keys())
    assert storage.hierarchy.tiers[1].writer.depth == 0
    assert not _disk_holds(storage, bad[0].key, _expected(copier, bad[0].block_ids))
    assert set(cpu.keys()) <= before  # (the reservation may have evicted one)
    # The aborted memory is reused by the next save, which stores its own bytes.
    good = _items(200, 1)
    _save(storage, q, good)
    want = _expected(copier, good[0].block_ids)
    out = torch.empty_like(want)
    assert storage.get_into_memory([good[0].key], [out]) == [True] and torch.equal(out, want)
    assert _disk_holds(storage, good[0].key, want)


def test_without_reservations_saves_copy_as_before(setup: Any) -> None:
    storage, copier, q, _ = setup
    q.use_reservations = False
    _save(storage, q, _items(0, 8))
    assert q.reserved == 0 and q.stored == 8
    assert storage.hierarchy.tiers[0].backend.stats()["reservations_committed"] == 0
    for it in _items(4, 4):
        assert _disk_holds(storage, it.key, _expected(copier, it.block_ids))


class _Event:
    """A device copy's event (an extra fake layer: CUDA events exist only on a GPU);
    ``done`` is set by the test, as the device would."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        pass


class _AsyncCopier:
    """The real copier's gathers, each returning an event as on CUDA."""

    def __init__(self, real: BlockCopier) -> None:
        self.real = real
        self.device = real.device
        self.events: list[_Event] = []

    def gather_to_host(self, block_ids: list[int], buf: torch.Tensor, other: Any) -> Any:
        self.real.gather(block_ids, buf)
        self.events.append(_Event())
        return self.events[-1]


def test_events_of_complete_gathers_are_forgotten_each_step(setup: Any) -> None:
    """A request whose end needs no wait for its saves is never asked about again: its
    events must not stay (they did, one list per request, on CUDA)."""
    storage, copier, q, _ = setup
    fake = _AsyncCopier(copier)
    q.copier = fake  # type: ignore[assignment]
    _save(storage, q, _items(0, 3))
    assert q.stored == 3
    q.prune_events()
    assert len(q._events) == 3  # no gather complete yet: all kept
    fake.events[0].done = fake.events[2].done = True
    q.prune_events()
    assert set(q._events) == {"r1"}
    assert not q.gathered_for("r1")
    fake.events[1].done = True
    q.prune_events()
    assert not q._events and q.gathered_for("r1")
