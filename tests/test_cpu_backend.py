"""cpu backend specifics beyond the contract suite."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from lmcache_core import ConfigError, CPUBackend, SizeFormatError, parse_bytes
from lmcache_core.backends.host_buffers import ENTRY_OVERHEAD
from lmcache_core.testing import make_key, random_tensor, run_async, same_bits

MiB = 1 << 20
ENTRY = MiB + ENTRY_OVERHEAD  # what one 1 MiB entry takes of max_bytes


def test_accepts_human_sizes_and_rejects_bad_ones() -> None:
    assert CPUBackend({"max_bytes": "8GiB"}).max_bytes == 8 << 30
    assert CPUBackend({"max_bytes": 4096}).max_bytes == 4096
    with pytest.raises(ConfigError) as info:
        CPUBackend({"max_bytes": "8 parsecs"})
    assert "options.max_bytes" in str(info.value)
    with pytest.raises(ConfigError):
        CPUBackend({"max_bytes": 0})
    with pytest.raises(ConfigError) as info2:
        CPUBackend({"max_byts": "1GiB"})
    assert "max_byts" in str(info2.value)
    with pytest.raises(SizeFormatError):
        parse_bytes(-1)


def test_pin_memory_true_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: pinning works")
    b = CPUBackend({"pin_memory": "true"})
    with pytest.raises(ConfigError, match="CUDA"):
        run_async(b.start())
    auto = CPUBackend()
    run_async(auto.start())
    assert auto.stats()["pinned"] is False


def test_lru_eviction_order_and_stats() -> None:
    async def body() -> None:
        b = CPUBackend({"max_bytes": 4 * ENTRY})
        await b.start()
        keys = [make_key(f"e{i}") for i in range(4)]
        vals = [random_tensor((MiB,), torch.uint8, seed=i) for i in range(4)]
        for k, v in zip(keys, vals, strict=True):
            assert await b.put(k, v)
        assert await b.get(keys[0]) is not None  # 0 becomes most recent
        assert await b.put(make_key("new"), random_tensor((MiB,), torch.uint8, seed=9))
        assert not await b.contains(keys[1]), "least recently used entry should go first"
        assert await b.contains(keys[0])
        s = b.stats()
        assert s["evictions"] == 1 and s["used_bytes"] == 4 * ENTRY and s["entries"] == 4
        assert s["data_bytes"] == 4 * MiB
        await b.close()

    run_async(body())


def test_entry_being_read_is_not_evicted() -> None:
    async def body() -> None:
        # big values take the worker-thread path, so a read is in flight across awaits
        b = CPUBackend({"max_bytes": 32 * MiB, "inline_copy_bytes": MiB})
        await b.start()
        k = make_key("reading")
        v = random_tensor((16 * MiB,), torch.uint8, seed=1)
        assert await b.put(k, v)
        out = torch.empty_like(v)
        read = asyncio.ensure_future(b.get_into(k, out))
        await asyncio.sleep(0)
        # needs the room of the entry being read: must be refused, not evict it
        stored = await b.put(make_key("big"), random_tensor((24 * MiB,), torch.uint8, seed=2))
        assert await read
        assert same_bits(out, v)
        if stored:
            assert not await b.contains(k)
        assert b.stats()["used_bytes"] <= 32 * MiB
        await b.close()

    run_async(body())


def test_eviction_listener_sees_evicted_value() -> None:
    async def body() -> None:
        b = CPUBackend({"max_bytes": 2 * ENTRY})
        seen: list[tuple[object, torch.Tensor]] = []
        b.set_eviction_listener(lambda k, t: seen.append((k, t.clone())))
        await b.start()
        k0 = make_key("l0")
        v0 = random_tensor((MiB,), torch.uint8, seed=0)
        await b.put(k0, v0)
        await b.put(make_key("l1"), random_tensor((MiB,), torch.uint8, seed=1))
        await b.put(make_key("l2"), random_tensor((MiB,), torch.uint8, seed=2))
        assert len(seen) == 1 and seen[0][0] == k0 and same_bits(seen[0][1], v0)
        await b.close()

    run_async(body())


def test_buffers_are_reused() -> None:
    async def body() -> None:
        b = CPUBackend({"max_bytes": 8 * MiB})
        await b.start()
        k = make_key("r")
        await b.put(k, random_tensor((MiB,), torch.uint8, seed=0))
        buf_ptr = b._entries[k].buf.data_ptr()
        v1 = random_tensor((MiB,), torch.uint8, seed=1)
        await b.put(k, v1)  # same size: overwritten in place
        assert b._entries[k].buf.data_ptr() == buf_ptr
        assert same_bits(await b.get(k), v1)
        s = b.stats()
        assert s["recycled_bytes"] == 0 and s["used_bytes"] == ENTRY
        await b.put(k, random_tensor((2 * MiB,), torch.uint8, seed=2))  # other size: new buffer
        assert b.stats()["recycled_bytes"] == ENTRY
        await b.put(make_key("r2"), random_tensor((MiB,), torch.uint8, seed=3))
        assert b.stats()["recycled_bytes"] == 0, "the freed buffer should be reused"
        await b.close()

    run_async(body())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host memory")
def test_pinned_buffers_and_device_values_when_cuda_is_available() -> None:  # pragma: no cover
    async def body() -> None:
        b = CPUBackend({"max_bytes": 64 * MiB})
        await b.start()
        assert b.stats()["pinned"] is True
        k = make_key("gpu")
        v = random_tensor((MiB,), torch.uint8, seed=1).cuda()
        assert await b.put(k, v)
        assert b._entries[k].buf.is_pinned()
        out = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        assert await b.get_into(k, out)
        assert torch.equal(out.cpu(), v.cpu())
        await b.close()

    run_async(body())


def test_mixed_size_put_storm_never_crashes() -> None:
    """Issue 10: an emptied size bucket left in the free pool made a later put raise
    ``IndexError: pop from empty list``."""

    async def body() -> None:
        b = CPUBackend({"max_bytes": MiB})
        await b.start()
        rng = random.Random(1)
        sizes = [0, 1, 7, 100, 4096, 65536, 300_000]
        src = torch.zeros(300_000, dtype=torch.uint8)
        for _ in range(3000):
            await b.put(make_key(f"k{rng.randrange(200)}"), src[: rng.choice(sizes)])
        s = b.stats()
        assert s["used_bytes"] + s["recycled_bytes"] <= MiB
        await b.close()

    run_async(body())


def test_zero_byte_values_are_bounded() -> None:
    """Issue 10: 0-byte values cost nothing against the bound, so any number was kept."""

    async def body() -> None:
        b = CPUBackend({"max_bytes": 64 * 1024})
        await b.start()
        empty = torch.empty(0, dtype=torch.float16)
        keys = [make_key(f"z{i}") for i in range(1000)]
        for k in keys:
            assert await b.put(k, empty)
        s = b.stats()
        assert s["entries"] == 64 * 1024 // b.entry_cost(0) < 1000
        assert s["used_bytes"] <= 64 * 1024
        got = await b.get(keys[-1])  # the newest are kept, and read back as stored
        assert got is not None and got.shape == (0,) and got.dtype == torch.float16
        await b.close()

    run_async(body())


def test_every_entry_is_charged_its_overhead() -> None:
    async def body() -> None:
        b = CPUBackend({"max_bytes": 8 * MiB})
        await b.start()
        assert b.entry_cost(0) == ENTRY_OVERHEAD
        assert b.entry_cost(1) >= 1 + ENTRY_OVERHEAD
        for i, n in enumerate((1, 100, 4096, MiB)):
            await b.put(make_key(f"o{i}"), torch.zeros(n, dtype=torch.uint8))
        s = b.stats()
        assert s["data_bytes"] == 1 + 100 + 4096 + MiB
        assert s["used_bytes"] == sum(b.entry_cost(n) for n in (1, 100, 4096, MiB))
        await b.close()

    run_async(body())


def test_a_donated_view_of_a_larger_tensor_is_copied() -> None:
    """Keeping a donated slice would keep its whole storage alive, uncounted."""

    async def body() -> None:
        b = CPUBackend({"max_bytes": 8 * MiB})
        await b.start()
        big = random_tensor((4 * MiB,), torch.uint8, seed=3)
        part = big[MiB : 2 * MiB]
        kv, kw = make_key("view"), make_key("whole")
        assert await b.put(kv, part, donate=True)
        kept = b._entries[kv].buf
        assert kept.untyped_storage().nbytes() < 4 * MiB
        assert same_bits(await b.get(kv), part)
        whole = random_tensor((MiB,), torch.uint8, seed=4)
        assert await b.put(kw, whole, donate=True)  # its own storage: kept as is
        assert b._entries[kw].buf.data_ptr() == whole.data_ptr()
        await b.close()

    run_async(body())


def test_freed_large_buffers_are_reused_for_other_sizes() -> None:
    """A freed memory map is resized for a value of another size instead of a new one."""

    async def body() -> None:
        b = CPUBackend({"max_bytes": 4 * MiB})
        await b.start()
        ka, kb = make_key("a"), make_key("b")
        await b.put(ka, torch.ones(3 * MiB, dtype=torch.uint8))
        ptr = b._entries[ka].buf.data_ptr()
        await b.put(kb, torch.full((2 * MiB,), 7, dtype=torch.uint8))  # evicts a
        assert not await b.contains(ka)
        assert b._entries[kb].buf.data_ptr() == ptr  # a's memory, shrunk in place
        assert same_bits(await b.get(kb), torch.full((2 * MiB,), 7, dtype=torch.uint8))
        s = b.stats()
        assert s["used_bytes"] + s["recycled_bytes"] <= 4 * MiB
        await b.close()

    run_async(body())


def test_oversize_keys_are_refused_at_put() -> None:
    """Issue 10: a key whose string exceeded the object header limit was stored but could
    never be read back (file tiers); every backend now refuses it at put, clearly."""
    from lmcache_core import KeyFormatError, TieredHierarchy
    from lmcache_core.keys import MAX_KEY_BYTES, CacheEngineKey

    huge = CacheEngineKey("m" * (MAX_KEY_BYTES + 1), 1, 0, 1, "float16")

    async def body() -> None:
        for backend in (CPUBackend(), TieredHierarchy.from_config(None)):
            await backend.start()
            with pytest.raises(KeyFormatError, match="longer than"):
                await backend.put(huge, torch.zeros(4))
            with pytest.raises(KeyFormatError):
                await backend.batched_put([make_key("ok"), huge], [torch.zeros(4)] * 2)
            assert await backend.get(huge) is None
            await backend.close()

    run_async(body())


def test_oversize_keys_are_refused_by_the_thread_safe_put_too() -> None:
    from lmcache_core import KeyFormatError, SyncBackend
    from lmcache_core.keys import MAX_KEY_BYTES, CacheEngineKey

    huge = CacheEngineKey("m" * (MAX_KEY_BYTES + 1), 1, 0, 1, "float16")
    b = CPUBackend()
    assert b.try_batched_put_threadsafe([huge], [torch.zeros(4)]) is None  # not started
    with SyncBackend(b) as sb:
        assert b.try_batched_put_threadsafe([huge], [torch.zeros(4)]) == [None]  # undecided
        with pytest.raises(KeyFormatError, match="longer than"):
            sb.batched_put([huge], [torch.zeros(4)])
        assert b.stats()["entries"] == 0


def test_a_borrowed_view_is_never_evicted_overwritten_or_recycled() -> None:
    """A borrow (the vLLM connector copies straight out of the tier) keeps its view's
    bytes: eviction skips the entry, a put of the same key installs a new entry instead of
    writing in place, a removal keeps the memory, and nothing reuses it until the borrow
    ends."""

    async def body() -> None:
        b = CPUBackend({"max_bytes": 2 * ENTRY, "inline_copy_bytes": 2 * MiB})
        await b.start()
        k, other = make_key("borrowed"), make_key("other")
        v = random_tensor((MiB,), torch.uint8, seed=1)
        assert await b.put(k, v)
        res = b.try_borrow_threadsafe([k, make_key("absent")])
        assert res is not None and res[1] is None
        handle, view = res[0]  # type: ignore[misc]
        assert same_bits(view, v)
        # a same-sized overwrite would be done in place without the borrow
        assert await b.put(k, random_tensor((MiB,), torch.uint8, seed=2))
        assert same_bits(view, v)
        assert same_bits(await b.get(k), random_tensor((MiB,), torch.uint8, seed=2))
        # capacity pressure: the borrowed (now replaced) memory still counts and is kept
        assert await b.put(other, random_tensor((MiB,), torch.uint8, seed=3)) in (True, False)
        assert await b.remove(k) in (True, False)
        for i in range(4):
            await b.put(make_key(f"fill{i}"), random_tensor((MiB,), torch.uint8, seed=10 + i))
        assert same_bits(view, v)
        with pytest.raises(TypeError):
            b.end_borrows([handle, object()])
        b.end_borrows([handle])
        s = b.stats()
        assert s["used_bytes"] <= 2 * ENTRY
        # its memory is reusable now: the tier can hold two fresh entries
        for i in range(2):
            assert await b.put(make_key(f"after{i}"), random_tensor((MiB,), torch.uint8, seed=20))
        assert b.try_borrow_threadsafe([]) == []
        await b.close()
        assert b.try_borrow_threadsafe([k]) is None  # not started

    run_async(body())


def test_a_borrowed_entry_is_skipped_by_eviction() -> None:
    async def body() -> None:
        b = CPUBackend({"max_bytes": 2 * ENTRY})
        await b.start()
        keys = [make_key(f"b{i}") for i in range(2)]
        for i, k in enumerate(keys):
            assert await b.put(k, random_tensor((MiB,), torch.uint8, seed=i))
        res = b.try_borrow_threadsafe([keys[0]])
        assert res is not None and res[0] is not None
        # keys[1] is now the least recently used; borrow keys[1] as well -> nothing evictable
        res1 = b.try_borrow_threadsafe([keys[1]])
        assert res1 is not None and res1[0] is not None
        assert not await b.put(make_key("new"), random_tensor((MiB,), torch.uint8, seed=5))
        assert await b.contains(keys[0]) and await b.contains(keys[1])
        b.end_borrows([res[0][0], res1[0][0]])
        assert await b.put(make_key("new"), random_tensor((MiB,), torch.uint8, seed=5))
        await b.close()

    run_async(body())


def test_release_pinned_cache_asks_torch_to_free_its_cached_host_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A closed pinned tier hands torch's cached page-locked blocks back (torch keeps
    them otherwise); the call works with either name torch has for it, and a build
    whose call fails (no accelerator) is no error."""
    from lmcache_core.backends.cpu import release_pinned_cache

    calls: list[str] = []

    def failing() -> None:
        calls.append("host")
        raise RuntimeError("no accelerator")

    monkeypatch.setattr(torch._C, "_host_emptyCache", failing, raising=False)
    monkeypatch.setattr(
        torch._C, "_accelerator_emptyHostCache", lambda: calls.append("acc"), raising=False
    )
    release_pinned_cache()
    assert calls == ["host", "acc"]
