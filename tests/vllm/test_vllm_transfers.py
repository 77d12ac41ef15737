"""The worker's transfer machinery on real storage and synthetic caches (no engine):
bounded saves, background loads with deadlines, background lookups with deadlines, and
the deprecated ``io_timeout_s``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from copy_checks import BLOCKS, LAYERS, caches, fill
from kv_test_backends import write_control

from lmcache_core import ChunkedTokenDatabase, Namespace
from lmcache_core.config import load_config
from lmcache_core.integrations.vllm.layout import BlockCopier
from lmcache_core.integrations.vllm.loads import AsyncLoads
from lmcache_core.integrations.vllm.lookups import ViewLookups
from lmcache_core.integrations.vllm.metadata import ChunkLoad
from lmcache_core.integrations.vllm.saves import SaveItem, SaveQueue
from lmcache_core.integrations.vllm.staging import ChunkBuffers
from lmcache_core.integrations.vllm.storage import Storage

NS = Namespace(model_name="m", chunk_size=32, block_size=16)
DB = ChunkedTokenDatabase(namespace=NS)


def _storage(tmp_path: Path, **control: Any) -> Storage:
    ctl = tmp_path / "control.json"
    write_control(str(ctl), **control)
    cfg = load_config(
        {
            "chunk_size": 32,
            "drain_timeout_s": 0.5,
            "tiers": [
                {
                    "name": "cpu",
                    "backend_class": "kv_test_backends:FaultyCPUBackend",
                    "options": {"max_bytes": "16MiB", "control": str(ctl)},
                },
                {
                    "name": "disk",
                    "backend_class": "kv_test_backends:SlowDiskBackend",
                    "options": {"path": str(tmp_path / "disk"), "control": str(ctl)},
                },
            ],
        }
    )
    return Storage(cfg, NS)


@pytest.fixture
def setup(tmp_path: Path) -> Any:
    views = caches("cpu", "LBHNC")
    fill(views, 3)
    copier = BlockCopier(views, BLOCKS)
    storage = _storage(tmp_path)
    yield storage, copier, views, tmp_path
    storage.close()


def _wait(pred: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def _on_disk(storage: Storage, copier: BlockCopier, keys: list[Any]) -> torch.Tensor:
    """Store chunk ``c`` of ``keys`` (blocks ``2c`` and ``2c + 1`` of the source cache) in
    the disk tier only; returns the last chunk stored."""
    src = torch.empty(copier.chunk_shape(2))
    for c, k in enumerate(keys):
        copier.gather([2 * c, 2 * c + 1], src)
        storage.submit(storage.hierarchy.tiers[1].backend.put(k, src)).result(timeout=10)
    return src


def test_saves_gather_then_store_in_the_background_and_drop_when_staging_is_full(
    setup: Any,
) -> None:
    storage, copier, views, tmp_path = setup
    write_control(str(tmp_path / "control.json"), put_delay_s=1.0)
    buffers = ChunkBuffers(copier.chunk_shape(2), torch.float32, max_buffers=2)
    q = SaveQueue(storage, buffers, copier)
    items = [SaveItem(DB.make_key(i), i, "r", i, [2 * i, 2 * i + 1]) for i in range(3)]
    dropped = q.submit(items)
    assert q.pending == 2  # the stores (1 s each) are not waited for: both still run
    assert [d.chunk_hash for d in dropped] == [2] and q.dropped_full == 1
    assert q.take_stored() == []  # not in the memory tier yet: not reported
    _wait(lambda: q.pending == 0)
    assert sorted(h for h, _, _ in q.take_stored()) == [0, 1]
    out = torch.empty(copier.chunk_shape(2))
    assert storage.get_into([DB.make_key(1)], [out]) == [True]
    assert torch.equal(out[:, 0], torch.stack([v[2] for v in views]))
    # Shutdown with stores pending: drained up to the timeout, the rest counted.
    write_control(str(tmp_path / "control.json"), put_delay_s=5.0)
    assert q.submit(items[:2]) == []
    assert q.pending == 2
    assert q.drain(0.2) == 2
    # The cancelled stores end as refused and give their staging buffers back.
    _wait(lambda: q.pending == 0 and buffers.in_use == 0)
    assert sorted(i for _, i in q.take_refused()) == [0, 1]


def test_background_load_scatters_when_done_and_fails_past_its_deadline(setup: Any) -> None:
    storage, copier, views, tmp_path = setup
    src = torch.empty(copier.chunk_shape(2))
    for i in range(3):
        copier.gather([2 * i, 2 * i + 1], src)
        assert storage.put([DB.make_key(100 + i)], [src]) == [True]
    dst_views = caches("cpu", "LBHNC")
    dst = BlockCopier(dst_views, BLOCKS)
    buffers = ChunkBuffers(copier.chunk_shape(2), torch.float32, max_buffers=2)
    loads = AsyncLoads(storage, buffers, dst, deadline_s=0.5, block_nbytes=1)

    def job(req: str, n: int, first_block: int) -> list[ChunkLoad]:
        return [
            ChunkLoad(req, c, 100 + c, 0, [first_block + 2 * c, first_block + 2 * c + 1])
            for c in range(n)
        ]

    loads.start("a", job("a", 3, 0), [DB.make_key(100 + c) for c in range(3)])
    done: set[str] = set()
    _wait(lambda: done.update(loads.poll().finished) or "a" in done)
    assert buffers.in_use == 0  # 3 chunks through 2 buffers, all given back
    for layer in range(LAYERS):
        assert torch.equal(dst_views[layer][:6], views[layer][:6])
    # A slow tier: the load is abandoned at its deadline, its blocks fail; the late
    # reads finish into staging memory only, whose buffers come back afterwards.
    write_control(str(tmp_path / "control.json"), get_delay_s=3.0, fail=[])
    storage.hierarchy.tiers[0].backend.control.get()  # (the memory tier too)
    loads.poll()
    loads.start("b", job("b", 2, 8), [DB.make_key(100 + c) for c in range(2)])
    t0 = time.monotonic()
    _wait(lambda: "b" in (out := loads.poll()).finished and bool(out.failed_blocks))
    assert time.monotonic() - t0 > 0.4  # not before its deadline
    assert buffers.in_use > 0  # at its deadline: the (3 s) reads still run
    assert loads.deadline_misses == 1
    assert not dst_views[0][8:12].any()
    _wait(lambda: buffers.in_use == 0, timeout=10)


def test_an_idle_step_waits_for_background_loads_to_progress_not_longer(setup: Any) -> None:
    storage, copier, _views, tmp_path = setup
    src = torch.empty(copier.chunk_shape(2))
    copier.gather([0, 1], src)
    assert storage.put([DB.make_key(300)], [src]) == [True]
    storage.hierarchy.tiers[0].backend.control.get()
    loads = AsyncLoads(
        storage,
        ChunkBuffers(copier.chunk_shape(2), torch.float32, max_buffers=2),
        BlockCopier(caches("cpu", "LBHNC"), BLOCKS),
        deadline_s=5.0,
        block_nbytes=1,
    )
    t0 = time.perf_counter()
    loads.wait_progress(20.0)  # no load running: no wait
    assert time.perf_counter() - t0 < 10.0
    write_control(str(tmp_path / "control.json"), get_delay_s=1.0)
    storage.hierarchy.tiers[0].backend.control.get()
    loads.start("r", [ChunkLoad("r", 0, 300, 0, [2, 3])], [DB.make_key(300)])
    _wait(lambda: loads.poll() is not None and loads.pending_fetches() == 1)
    t0 = time.perf_counter()
    loads.wait_progress(0.05)  # the fetch takes 1 s: the wait ends at its bound
    assert time.perf_counter() - t0 >= 0.04
    assert not loads._progress.is_set()  # (nothing to act on yet: it did not wait for that)
    loads.wait_progress(20.0)  # woken by the fetch finishing, not by the bound
    assert time.perf_counter() - t0 < 10.0
    assert "r" in loads.poll().finished


def test_background_lookup_answers_later_and_gives_up_at_its_deadline(setup: Any) -> None:
    storage, copier, _, tmp_path = setup
    src = torch.empty(copier.chunk_shape(2))
    assert storage.put([DB.make_key(7)], [src]) == [True]
    lk = ViewLookups(storage, deadline_s=0.3, lease_s=10.0, reuse_s=5.0)
    keys = [[DB.make_key(7), DB.make_key(8)]]
    res = None
    while res is None:
        res = lk.poll("r", [0], keys)
    assert res.found == [1] and res.pinned == [1]  # the memory tier pins
    lk.release("r")
    write_control(str(tmp_path / "control.json"), lookup_delay_s=1.0)
    storage.hierarchy.tiers[0].backend.control.get()
    assert lk.poll("q", [0], [[DB.make_key(50)]]) is None  # running: ask again later
    time.sleep(0.35)
    assert lk.poll("q", [0], [[DB.make_key(50)]]).found == [0]
    assert lk.deadline_misses == 1
    assert lk.poll("q", [0], [[DB.make_key(50)]]).found == [0]  # answered, not restarted
    assert lk.started == 2


def test_io_timeout_is_deprecated_and_becomes_the_load_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from lmcache_core.integrations.vllm.settings import parse_settings

    with caplog.at_level("WARNING"):
        s = parse_settings({"io_timeout_s": 9})
    assert s.options.load_deadline_s == 9 and "deprecated" in caplog.text
    s = parse_settings({"io_timeout_s": 9, "load_deadline_s": 2})
    assert s.options.load_deadline_s == 2
    assert parse_settings(None).options.lookup_deadline_ms == 20


def test_an_early_lookup_answers_for_a_later_start(setup: Any) -> None:
    storage, copier, _, _ = setup
    src = torch.empty(copier.chunk_shape(2))
    keys = [DB.make_key(60 + i) for i in range(3)]
    assert storage.put(keys, [src, src, src]) == [True] * 3
    lk = ViewLookups(storage, deadline_s=5.0, lease_s=10.0, reuse_s=5.0)
    lk.prefetch("r", [0], [keys])  # when vLLM receives the request
    _wait(lambda: lk.poll("r", [0], [keys]) is not None)
    # vLLM's own prefix cache already holds chunk 0: the same lookup answers for 1..
    res = lk.poll("r", [1], [keys[1:]])
    assert res is not None and res.found == [2] and res.pinned == [2]
    assert lk.started == 1
    lk.release("r")


def test_a_background_load_releases_only_the_leases_its_lookup_took(tmp_path: Path) -> None:
    """A hit this load's lookup did not pin (found in a tier that cannot pin) is not
    released when the load ends: ``release`` ends one lease per key whoever took it, so
    that would end another caller's lease on the same chunk."""
    cfg = load_config(
        {
            "chunk_size": 32,
            "tiers": [
                {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "16MiB"}},
                {
                    "name": "ref",
                    "backend_class": "lmcache_core.testing.reference:ReferenceBackend",
                },
            ],
        }
    )
    storage = Storage(cfg, NS)
    try:
        views = caches("cpu", "LBHNC")
        fill(views, 5)
        copier = BlockCopier(views, BLOCKS)
        src = torch.empty(copier.chunk_shape(2))
        copier.gather([0, 1], src)
        key = DB.make_key(300)
        lower = storage.hierarchy.tiers[1].backend
        assert storage.sync.io.run(lower.put(key, src))  # only in the tier that cannot pin
        dst_views = caches("cpu", "LBHNC")
        buffers = ChunkBuffers(copier.chunk_shape(2), torch.float32, max_buffers=2)
        loads = AsyncLoads(
            storage, buffers, BlockCopier(dst_views, BLOCKS), deadline_s=5.0, block_nbytes=1
        )
        loads.start("a", [ChunkLoad("a", 0, 300, 0, [4, 5])], [key])
        lookup = loads._jobs["a"].lookup
        assert lookup is not None
        _wait(lookup.done)
        assert lookup.result().num_hit == 1 and lookup.result().pinned == (False,)
        # Another caller now finds the chunk in the memory tier and leases it.
        assert storage.put([key], [src]) == [True]
        other = storage.lookup([key], lease_s=60.0)
        assert other.num_hit == 1 and other.pinned == (key,)  # the memory tier pins
        done: set[str] = set()
        _wait(lambda: done.update(loads.poll().finished) or "a" in done)
        for layer in range(LAYERS):
            assert torch.equal(dst_views[layer][4:6], views[layer][0:2])
        time.sleep(0.05)  # a release the load queued on the IO loop would have run by now
        assert storage.release(other.pinned) == 1  # the other caller's lease survived
        assert storage.release(other.pinned) == 0
    finally:
        storage.close()


def test_sync_loads_borrow_from_the_memory_tier_and_listed_chunks_miss(setup: Any) -> None:
    """The worker's synchronous loads copy straight out of the memory tier (a borrow): the
    view is the stored chunk, it stays intact while borrowed even when the key is stored
    again, a chunk the test tier fails is a miss there too, and every borrow ends."""
    storage, copier, views, tmp_path = setup
    src = torch.empty(copier.chunk_shape(2))
    keys = [DB.make_key(200 + i) for i in range(3)]
    for i, k in enumerate(keys):
        copier.gather([2 * i, 2 * i + 1], src)
        assert storage.put([k], [src]) == [True]
    write_control(str(tmp_path / "control.json"), fail=[keys[2].chunk_hash_hex])
    storage.hierarchy.tiers[0].backend.control.get()
    borrowed = storage.borrow_from_memory([*keys, DB.make_key(999)])
    assert borrowed is not None
    assert [b is not None for b in borrowed] == [True, True, False, False]
    first = borrowed[0]
    assert first is not None
    kept = first[1].clone()
    assert torch.equal(kept[:, 0], torch.stack([v[0] for v in views]))
    copier.gather([6, 7], src)  # another value under the same key, same size
    assert storage.put([keys[0]], [src]) == [True]
    assert torch.equal(first[1], kept)  # the borrowed bytes were not overwritten
    dst_views = caches("cpu", "LBHNC")
    dst = BlockCopier(dst_views, BLOCKS)
    dst.scatter_from_host(first[1], [4, 5])
    for layer in range(LAYERS):
        assert torch.equal(dst_views[layer][4:6], views[layer][0:2])
    cpu = storage.hierarchy.tiers[0].backend
    assert cpu.stats()["entries"] >= 3
    storage.end_borrows([b[0] for b in borrowed if b is not None])
    # every reference ended: the replaced entry's memory went back to the pool
    assert all(e.users == 0 for e in cpu._entries.values())


def test_copy_threads_run_below_the_process_priority_and_the_io_loop_does_not(
    tmp_path: Path,
) -> None:
    import asyncio
    import os
    import threading

    from lmcache_core.integrations.vllm.storage import COPY_THREAD_PREFIX

    def nice() -> tuple[str, int]:
        me = threading.current_thread()
        return me.name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def both() -> tuple[tuple[str, int], tuple[str, int]]:
        return nice(), await asyncio.to_thread(nice)

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    cfg = load_config({"chunk_size": 32, "tiers": [{"name": "cpu", "backend": "cpu"}]})
    storage = Storage(cfg, NS, copy_nice=5)
    try:
        (_, loop_nice), (copy_name, copy_nice) = storage.sync.io.run(both())
    finally:
        storage.close()
    assert loop_nice == base
    assert copy_name.startswith(COPY_THREAD_PREFIX) and copy_nice == min(19, base + 5)


def test_layer_copies_fill_each_layer_before_its_wait_returns_and_end_with_the_callback() -> None:
    import threading

    from lmcache_core.integrations.vllm.layer_copy import LayerCopies

    src_views = caches("cpu", "LBHNC")
    fill(src_views, 5)
    copier = BlockCopier(src_views, BLOCKS)
    src = torch.empty(copier.chunk_shape(2))
    copier.gather([0, 1], src)
    dst_views = caches("cpu", "LBHNC")
    assert LayerCopies.usable(dst_views)
    names = [f"layer{i}" for i in range(LAYERS)]
    copies = LayerCopies(names, dst_views)
    per_layer: list[list[tuple[int, int, int]]] = [[] for _ in range(LAYERS)]
    assert copies.plan(per_layer, src, 0, [4, 5])
    assert copies.plan(per_layer, src, 1, [9])  # a run of one block, from the chunk's second
    assert not copies.plan(per_layer, src, 0, [BLOCKS - 1, BLOCKS])  # out of range
    assert not copies.plan(per_layer, src[:, :1].clone(), 0, [1, 2])  # past the chunk
    assert not copies.plan(per_layer, src.transpose(3, 4), 0, [1])  # not the layout
    assert all(len(segs) == 2 for segs in per_layer)
    ended = threading.Event()
    copies.start(per_layer, ended.set)
    for layer, name in enumerate(names):
        copies.wait_layer(name)
        assert torch.equal(dst_views[layer][4:6], src_views[layer][0:2])
        assert torch.equal(dst_views[layer][9], src_views[layer][1])
    copies.wait_all()
    assert ended.is_set()
    assert not dst_views[0][6:9].any()  # nothing else written
    copies.close()


def test_a_layer_name_the_copies_do_not_know_waits_for_every_layer() -> None:
    import threading

    from lmcache_core.integrations.vllm.layer_copy import LayerCopies

    dst_views = caches("cpu", "LBHNC")
    copies = LayerCopies([f"layer{i}" for i in range(LAYERS)], dst_views)
    release = threading.Event()
    ended = threading.Event()
    per_layer: list[list[tuple[int, int, int]]] = [[] for _ in range(LAYERS)]

    def after() -> None:
        ended.set()

    # a batch whose copies cannot finish until released: the unknown name must wait
    copies.start(per_layer, lambda: (release.wait(5), after()))
    waiter = threading.Thread(target=copies.wait_layer, args=("model.layers.0.attn",))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # still waiting for the whole batch
    release.set()
    waiter.join(5)
    assert not waiter.is_alive() and ended.is_set()
    copies.close()


def test_a_background_load_reports_a_lower_tier_hit_before_promoting_it(setup: Any) -> None:
    """A disk hit lands in vLLM's blocks and is reported finished while its promotion into
    the memory tier still waits (held here); the promotion then copies from the same
    staging buffer, which comes back only afterwards, and the memory tier holds the exact
    chunk. A load of more chunks than staging buffers promotes early to free them."""
    import asyncio
    import threading

    storage, copier, views, _ = setup
    h = storage.hierarchy
    key = DB.make_key(700)
    src = _on_disk(storage, copier, [key])
    gate = threading.Event()
    real = h._copy_up  # (what get_into_deferred's promote runs)

    async def held_copy_up(*args: Any, **kw: Any) -> None:
        await asyncio.to_thread(gate.wait, 10.0)
        await real(*args, **kw)

    h._copy_up = held_copy_up  # type: ignore[method-assign]
    dst_views = caches("cpu", "LBHNC")
    buffers = ChunkBuffers(copier.chunk_shape(2), torch.float32, max_buffers=2)
    loads = AsyncLoads(
        storage, buffers, BlockCopier(dst_views, BLOCKS), deadline_s=5.0, block_nbytes=1
    )
    loads.start("p", [ChunkLoad("p", 0, 700, 0, [4, 5])], [key])
    done: set[str] = set()
    _wait(lambda: done.update(loads.poll().finished) or "p" in done)
    for layer in range(LAYERS):  # in place and reported, the promotion still held
        assert torch.equal(dst_views[layer][4:6], views[layer][0:2])
    assert buffers.in_use == 1 and not storage.submit(h.tiers[0].backend.contains(key)).result()
    gate.set()
    _wait(lambda: buffers.in_use == 0)
    storage.submit(h.flush()).result(timeout=10)
    out = torch.empty(copier.chunk_shape(2))
    assert storage.get_into_memory([key], [out]) == [True] and torch.equal(out, src)
    assert "promote" not in loads.spans[0] and loads.spans[0]["read"] > 0  # (not yet)
    assert loads.promoted == 1
    # 3 disk chunks through 2 buffers: promotions parked until the load is over would
    # hold both buffers, so they start early; the load finishes, all exact and promoted.
    h._copy_up = real  # type: ignore[method-assign]
    keys = [DB.make_key(710 + c) for c in range(3)]
    _on_disk(storage, copier, keys)
    loads.start(
        "q", [ChunkLoad("q", c, 710 + c, 0, [8 + 2 * c, 9 + 2 * c]) for c in range(3)], keys
    )
    _wait(lambda: done.update(loads.poll().finished) or "q" in done)
    for layer in range(LAYERS):
        assert torch.equal(dst_views[layer][8:14], views[layer][0:6])
    _wait(lambda: buffers.in_use == 0 and loads.promoted == 4)
    storage.submit(h.flush()).result(timeout=10)
    assert all(storage.submit(h.tiers[0].backend.contains(k)).result() for k in keys)


def test_an_idle_wait_ends_when_a_load_is_over_not_at_each_chunk(setup: Any) -> None:
    """The idle step's wait is not ended by one chunk of a load whose other chunk still
    runs (nothing for the step to report), only by the load being over; and a load of
    more chunks than staging buffers wakes every wait it needs (no wait runs to its bound)."""
    import asyncio

    storage, copier, views, _ = setup
    h = storage.hierarchy
    keys = [DB.make_key(800 + c) for c in range(4)]
    _on_disk(storage, copier, keys)
    real = h.get_into_deferred

    async def slow_second(key: Any, out: torch.Tensor) -> Any:
        if key == keys[1]:
            await asyncio.sleep(0.6)
        return await real(key, out)

    h.get_into_deferred = slow_second  # type: ignore[method-assign]
    dst_views = caches("cpu", "LBHNC")
    buffers = ChunkBuffers(copier.chunk_shape(2), torch.float32, max_buffers=2)
    loads = AsyncLoads(
        storage, buffers, BlockCopier(dst_views, BLOCKS), deadline_s=5.0, block_nbytes=1
    )

    def job(req: str, cs: range, first_block: int) -> list[ChunkLoad]:
        return [
            ChunkLoad(req, j, 800 + c, 0, [first_block + 2 * j, first_block + 2 * j + 1])
            for j, c in enumerate(cs)
        ]

    loads.start("r", job("r", range(2), 0), keys[:2])
    _wait(lambda: not loads.poll().finished and loads.pending_fetches() == 2)
    _wait(lambda: len(loads._jobs["r"].reported) == 1)  # the fast chunk is in place
    t0 = time.perf_counter()
    loads.wait_progress(0.2)  # the slow chunk still runs: the wait ends at its bound
    assert time.perf_counter() - t0 >= 0.15
    assert not loads.poll().finished
    loads.wait_progress(20.0)  # woken by the load being over (0.6 s)
    assert time.perf_counter() - t0 < 10.0
    assert "r" in loads.poll().finished
    for layer in range(LAYERS):
        assert torch.equal(dst_views[layer][0:4], views[layer][0:4])
    # A partial hit (the third chunk is in no tier: the lookup stops the load at two) whose
    # slow chunk is reported after a poll found nothing left to issue: still woken when
    # the load is over, not at the wait's bound.
    partial = [*job("p", range(2), 4), ChunkLoad("p", 2, 899, 0, [8, 9])]
    loads.start("p", partial, [*keys[:2], DB.make_key(899)])
    _wait(lambda: not loads.poll().finished and loads.pending_fetches() == 2)
    assert not loads.poll().finished  # (nothing left to issue)
    t0 = time.perf_counter()
    loads.wait_progress(20.0)
    assert time.perf_counter() - t0 < 10.0
    out = loads.poll()
    assert "p" in out.finished and out.failed_chunks.get("p") == [2]
    # 4 chunks through 2 buffers (promotions parked with theirs start early): every
    # wait is woken by what the next poll must do, none runs to its bound.
    h.get_into_deferred = real  # type: ignore[method-assign]
    _wait(lambda: buffers.in_use == 0)
    loads.start("s", job("s", range(4), 8), keys)
    done: set[str] = set()
    while "s" not in done:
        t1 = time.perf_counter()
        loads.wait_progress(20.0)
        assert time.perf_counter() - t1 < 10.0
        done.update(loads.poll().finished)
    for layer in range(LAYERS):
        assert torch.equal(dst_views[layer][8:16], views[layer][0:8])


def test_a_buffer_given_back_as_a_load_finds_none_free_is_taken_at_once(setup: Any) -> None:
    """A staging buffer given back by another thread between a load's failed ``take`` and
    the flag that makes a give wake the idle wait (so it woke nothing) is taken at once by
    the load: the chunk is issued in the same poll, and the idle wait ends when the load is
    over instead of running to its bound."""
    storage, copier, views, _ = setup
    key = DB.make_key(900)
    _on_disk(storage, copier, [key])
    held: list[torch.Tensor] = []

    class Racy(ChunkBuffers):
        armed = True
        loads: AsyncLoads

        def take(self) -> torch.Tensor | None:
            buf = super().take()
            if buf is None and self.armed:  # the race: the give lands right now
                self.armed = False
                self.loads._give(held)
            return buf

    buffers = Racy(copier.chunk_shape(2), torch.float32, max_buffers=1)
    held.append(buffers.take())  # (as a fetch still running would hold it)
    dst_views = caches("cpu", "LBHNC")
    loads = AsyncLoads(
        storage, buffers, BlockCopier(dst_views, BLOCKS), deadline_s=5.0, block_nbytes=1
    )
    buffers.loads = loads
    loads.start("x", [ChunkLoad("x", 0, 900, 0, [4, 5])], [key])
    _wait(lambda: loads.poll() is not None and not buffers.armed)
    assert loads._jobs["x"].next == 1  # issued in the poll that first found none free
    t0 = time.perf_counter()
    loads.wait_progress(20.0)
    assert time.perf_counter() - t0 < 10.0
    done: set[str] = set()
    _wait(lambda: done.update(loads.poll().finished) or "x" in done)
    for layer in range(LAYERS):
        assert torch.equal(dst_views[layer][4:6], views[layer][0:2])
