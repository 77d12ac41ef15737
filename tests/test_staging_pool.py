"""The hierarchy's staging pool: recycling by size, fresh memory faulted in ahead of use,
and the background top-up that keeps promotions off fresh memory."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from lmcache_core.hierarchy.staging import CopyBudget, StagingPool
from lmcache_core.hierarchy.tiered import TieredHierarchy
from lmcache_core.memory import populated_empty
from lmcache_core.testing import make_key, random_tensor

MiB = 1 << 20


def _wait(pred, timeout: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


def test_populated_memory_is_writable_and_outlives_its_mapping_references() -> None:
    t = populated_empty(3 * MiB + 5)
    assert t.dtype == torch.uint8 and t.numel() == 3 * MiB + 5
    t.fill_(7)
    view = t[MiB : MiB + 16].view(torch.int8)
    del t
    assert view.tolist() == [7] * 16
    assert populated_empty(0).numel() == 0


def test_small_buffers_are_plain_and_recycled_by_size() -> None:
    pool = StagingPool(spare_bytes=8 * MiB)
    a = pool.take(4096)
    pool.give(a)
    assert pool.take(4096).data_ptr() == a.data_ptr()
    assert pool.take(8192).data_ptr() != a.data_ptr()
    assert pool.prefaulted == 0  # small sizes get no spares
    pool.close()


def test_a_large_allocation_tops_the_size_up_in_the_background() -> None:
    pool = StagingPool(spare_bytes=4 * MiB)
    first = pool.take(MiB)
    assert pool.allocated == 1
    assert _wait(lambda: pool.prefaulted == 4), pool.prefaulted
    time.sleep(0.05)
    assert pool.prefaulted == 4 and pool.free_bytes == 4 * MiB  # never past spare_bytes
    taken = [pool.take(MiB) for _ in range(4)]
    assert pool.reused == 4 and pool.allocated == 1
    ptrs = {t.data_ptr() for t in [first, *taken]}
    assert len(ptrs) == 5  # five distinct buffers
    # taking the spares asked for more: the pool refills
    assert _wait(lambda: pool.free_bytes == 4 * MiB)
    pool.close()


def test_the_top_up_respects_max_free_bytes_and_stops_on_close() -> None:
    pool = StagingPool(max_free_bytes=2 * MiB, spare_bytes=16 * MiB)
    assert pool.spare_bytes == 2 * MiB
    pool.take(MiB)
    assert _wait(lambda: pool.prefaulted == 2)
    time.sleep(0.05)
    assert pool.free_bytes == 2 * MiB
    pool.close()
    assert not any(t.name == "lmcache-prefault" and t.is_alive() for t in threading.enumerate())
    pool.take(MiB)
    pool.take(MiB)
    pool.take(MiB)  # fresh now, and no thread comes back after close
    time.sleep(0.05)
    assert pool.prefaulted == 2
    assert not any(t.name == "lmcache-prefault" and t.is_alive() for t in threading.enumerate())


def test_no_spares_means_no_thread() -> None:
    pool = StagingPool(spare_bytes=0)
    pool.take(4 * MiB)
    time.sleep(0.05)
    assert pool.prefaulted == 0 and pool.free_bytes == 0
    assert pool._thread is None
    pool.close()


def test_promotions_from_a_lower_tier_copy_into_spares_and_stay_exact(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A cpu + disk hierarchy: chunks read from disk are promoted through staging buffers
    the pool faulted in ahead (few fresh allocations), and every promoted chunk is exact."""
    cfg = {
        "tiers": [
            {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "256MiB"}},
            {
                "name": "disk",
                "backend": "disk",
                "options": {"path": str(tmp_path / "kv"), "max_bytes": "1GiB"},
                "write": {"policy": "through"},
            },
        ]
    }
    n = 12
    keys = [make_key(i) for i in range(n)]
    values = [random_tensor((MiB,), torch.uint8, seed=i) for i in range(n)]

    async def fill() -> None:
        async with TieredHierarchy.from_config(cfg) as h:
            for k, v in zip(keys, values, strict=True):
                assert await h.put(k, v)
            await h.flush()

    async def reload() -> tuple[int, int, int, list[bool]]:
        exact = []
        async with TieredHierarchy.from_config(cfg) as h:  # a fresh process: empty cpu tier
            out = torch.empty(MiB, dtype=torch.uint8)
            for i, k in enumerate(keys):
                assert await h.get_into(k, out)
                exact.append(bool(torch.equal(out, values[i])))
                if i == 0:  # let the top-up run once (a real load has compute in between)
                    await asyncio.to_thread(_wait, lambda: h.pool.prefaulted >= 8)
            await h.flush()
            top = h.tiers[0].backend
            for i, k in enumerate(keys):  # the promoted copies in the cpu tier are exact
                got = torch.empty(MiB, dtype=torch.uint8)
                assert await top.get_into(k, got)
                exact.append(bool(torch.equal(got, values[i])))
            stats = (h.pool.allocated, h.pool.reused, h.pool.prefaulted)
        return (*stats, exact)

    asyncio.run(fill())
    allocated, reused, prefaulted, exact = asyncio.run(reload())
    assert all(exact)
    assert prefaulted >= 8
    assert reused >= 8 and allocated <= n - 8


def _cpu_over_disk(path: str) -> dict[str, object]:
    return {
        "tiers": [
            {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "64MiB"}},
            {
                "name": "disk",
                "backend": "disk",
                "options": {"path": path, "max_bytes": "256MiB"},
                "write": {"policy": "through"},
            },
        ]
    }


def test_content_addressed_hierarchy_writes_a_chunk_through_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With content-addressed keys (the connector's), a chunk the disk tier holds (it
    stored it, or served it, and its index still lists it) is not written to disk again;
    a chunk another process removed through the index is written again, and a miss in
    the tier forgets it. Without the flag a later store overwrites (the backend
    contract)."""
    cfg = _cpu_over_disk(str(tmp_path / "kv"))
    k, v = make_key(0), random_tensor((MiB,), torch.uint8, seed=1)
    other = random_tensor((MiB,), torch.uint8, seed=2)

    async def body() -> None:
        async with TieredHierarchy.from_config(cfg) as h:
            assert isinstance(h, TieredHierarchy)
            h.content_addressed = True
            disk = h.tier("disk")
            assert await h.put(k, v)
            await h.flush()
            stores = disk.stats.stores
            assert await h.put(k, v)  # the same chunk saved again: no second disk write
            await h.flush()
            assert disk.stats.stores == stores and disk.stats.known_skips == 1
            await disk.backend.remove(k)  # another process removes it through the index
            assert await h.put(k, v)  # the tier's own answer says it is gone: written
            await h.flush()
            assert disk.stats.stores == stores + 1 and disk.stats.known_skips == 1
            out = torch.empty(MiB, dtype=torch.uint8)
            assert await disk.backend.get_into(k, out) and torch.equal(out, v)
            await disk.backend.remove(k)
            assert await h.tiers[0].backend.remove(k)
            assert not await h.get_into(k, out)  # a miss in disk forgets what it knew
            assert k not in disk.known
            assert await h.put(k, v)
            await h.flush()
            assert disk.stats.stores == stores + 2

        async with TieredHierarchy.from_config(cfg) as h:  # default: later stores overwrite
            assert isinstance(h, TieredHierarchy)
            assert await h.put(k, other)
            await h.flush()
            out = torch.empty(MiB, dtype=torch.uint8)
            assert await h.tier("disk").backend.get_into(k, out) and torch.equal(out, other)

    asyncio.run(body())


def _two_cpu_tiers(promote: bool = True) -> dict:  # type: ignore[type-arg]
    lower: dict = {"name": "low", "backend": "cpu", "options": {"max_bytes": "64MiB"}}  # type: ignore[type-arg]
    if not promote:
        lower["promote"] = False
    return {"tiers": [{"name": "top", "backend": "cpu", "options": {"max_bytes": "64MiB"}}, lower]}


def test_a_deferred_get_promotes_only_when_the_caller_says_so() -> None:
    """``get_into_deferred``: a lower tier's hit is loaded at once and promoted into the
    top tier only when the caller awaits the promotion it was handed (from the buffer it
    loaded into); a top-tier hit, a miss and a tier with ``promote: false`` hand none."""
    k, other = make_key(1), make_key(2)
    v = random_tensor((2 * MiB,), torch.uint8, seed=3)

    async def run(promote: bool) -> list[object]:
        seen: list[object] = []
        async with TieredHierarchy.from_config(_two_cpu_tiers(promote)) as h:
            top, low = h.tiers[0].backend, h.tiers[1].backend
            assert await low.put(k, v)
            out = torch.empty(2 * MiB, dtype=torch.uint8)
            hit, promote_fn = await h.get_into_deferred(k, out)
            seen += [hit, torch.equal(out, v), promote_fn is not None]
            await h.flush()
            seen.append(await top.contains(k))  # not promoted by the load itself
            if promote_fn is not None:
                await promote_fn()
                await h.flush()
                got = torch.empty(2 * MiB, dtype=torch.uint8)
                seen.append(await top.get_into(k, got) and torch.equal(got, v))
                again = await h.get_into_deferred(k, out)  # now a top-tier hit
                seen.append(again[0] and again[1] is None)
            seen.append(await h.get_into_deferred(other, out) == (False, None))
            seen.append(h.stats()["hits"] >= 1 and h.stats()["misses"] >= 1)
        return seen

    assert asyncio.run(run(True)) == [True, True, True, False, True, True, True, True]
    assert asyncio.run(run(False)) == [True, True, False, False, True, True]


def test_a_promotion_tells_its_listener_once_the_top_tier_holds_the_chunk() -> None:
    """``promote(on_top_stored=fn)``: ``fn(True)`` runs once, when the top tier's store
    ran, with the chunk already there."""
    k = make_key(11)
    v = random_tensor((2 * MiB,), torch.uint8, seed=5)

    async def run() -> list[object]:
        seen: list[object] = []
        async with TieredHierarchy.from_config(_two_cpu_tiers(True)) as h:
            top, low = h.tiers[0].backend, h.tiers[1].backend
            assert await low.put(k, v)
            out = torch.empty(2 * MiB, dtype=torch.uint8)
            hit, promote_fn = await h.get_into_deferred(k, out)
            assert hit and promote_fn is not None
            calls: list[tuple[bool, bool]] = []

            def stored(ok: bool) -> None:  # (on the loop, right after the store)
                held = list(top.keys())
                calls.append((ok, k in held))

            await promote_fn(on_top_stored=stored)
            await h.flush()
            seen.append(calls)
        return seen

    assert asyncio.run(run()) == [[(True, True)]]


def test_a_promotion_into_a_full_top_tier_reuses_its_recycled_memory() -> None:
    """A top tier that evicted (so it holds recycled buffers) takes a promoted chunk into
    one of them: bit-exact, published when the promotion returns, listener told, and no
    buffer taken from the hierarchy's staging pool (which would be fresh memory)."""
    keys = [make_key(30 + i) for i in range(3)]
    values = [random_tensor((2 * MiB,), torch.uint8, seed=40 + i) for i in range(3)]
    cfg = {
        "tiers": [
            {"name": "top", "backend": "cpu", "options": {"max_bytes": "5MiB"}},  # two chunks
            {"name": "low", "backend": "cpu", "options": {"max_bytes": "64MiB"}},
        ]
    }

    async def run() -> list[object]:
        async with TieredHierarchy.from_config(cfg) as h:
            top, low = h.tiers[0].backend, h.tiers[1].backend
            for k, v in zip(keys, values, strict=True):
                assert await h.put(k, v)
            await h.flush()
            assert not await top.contains(keys[0])  # evicted: its buffer recycled
            takes: list[int] = []
            real_take = h.pool.take

            def counted(nbytes: int) -> torch.Tensor:
                takes.append(nbytes)
                return real_take(nbytes)

            h.pool.take = counted  # type: ignore[method-assign]
            out = torch.empty(2 * MiB, dtype=torch.uint8)
            hit, promote = await h.get_into_deferred(keys[0], out)
            assert hit and promote is not None and await low.contains(keys[0])
            heard: list[bool] = []
            await promote(on_top_stored=heard.append)
            got = torch.empty(2 * MiB, dtype=torch.uint8)
            exact = await top.get_into(keys[0], got) and torch.equal(got, values[0])
            return [heard, exact, takes, h.tiers[0].stats.promotions]

    assert asyncio.run(run()) == [[True], True, [], 1]


def test_chunk_buffers_fill_ahead_with_page_aligned_memory_that_take_reuses() -> None:
    from lmcache_core.integrations.vllm.staging import ChunkBuffers

    shape = (2, 4, 32768)  # 1 MiB of float32 per buffer
    bufs = ChunkBuffers(shape, torch.float32, max_buffers=3)
    assert bufs.fill() == 3 and bufs.fill() == 0 and bufs.in_use == 0
    taken = bufs.take_many(5)
    assert len(taken) == 3 and bufs.take() is None  # no more than max_buffers
    for t in taken:
        assert t.shape == shape and t.dtype == torch.float32
        assert t.data_ptr() % 4096 == 0  # O_DIRECT reads land in it directly
        t.fill_(1.5)
    for t in taken:
        bufs.give(t)
    assert bufs.in_use == 0
    small = ChunkBuffers((4, 8), torch.float16, max_buffers=2)  # small: plain tensors
    assert small.fill(1) == 1 and small.take() is not None and small.in_use == 1


def test_spares_on_the_copy_thread_stop_with_it() -> None:
    before = {t.ident for t in threading.enumerate()}  # (other tests' threads: not ours)

    def ours_alive() -> bool:
        return any(
            t.name.startswith(("lmcache-staging", "lmcache-prefault")) and t.ident not in before
            for t in threading.enumerate()
        )

    budget = CopyBudget()
    pool = StagingPool(spare_bytes=2 * MiB, background=budget.submit)
    pool.take(MiB)
    assert _wait(lambda: pool.prefaulted == 2)
    assert not any(  # no thread of its own
        t.name.startswith("lmcache-prefault") and t.ident not in before
        for t in threading.enumerate()
    )
    budget.close()
    pool.take(MiB)
    pool.take(MiB)  # short again: the top-up cannot be queued, nothing raises
    time.sleep(0.05)
    assert pool.prefaulted == 2
    assert _wait(lambda: not ours_alive())
    # a large copy asked for after close runs on the caller's thread
    src = torch.randint(0, 256, (2 * MiB,), dtype=torch.uint8)
    dst = torch.zeros(2 * MiB, dtype=torch.uint8)
    asyncio.run(budget.copy(dst, src))
    assert torch.equal(dst, src)
    assert budget._executor is None  # and no thread was started for it
    pool.close()
