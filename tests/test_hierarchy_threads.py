"""Loads from plain threads through SyncBackend: the thread-safe fast path and its safety."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch
from test_hierarchy_fakes import make_registry

from lmcache_core import BackendClosedError, BufferMismatchError, SyncBackend, TieredHierarchy
from lmcache_core.testing import make_key, random_tensor, same_bits

CHUNK = 64 * 1024


def two_tiers(hot_chunks: int = 64) -> TieredHierarchy:
    return TieredHierarchy.from_config(
        {
            "tiers": [
                {"name": "hot", "backend": "cpu", "options": {"max_bytes": hot_chunks * CHUNK}},
                {"name": "warm", "backend": "cpu", "options": {"max_bytes": "64MiB"}},
            ]
        },
        registry=make_registry(),
    )


def test_top_tier_hits_skip_the_loop_lower_hits_do_not() -> None:
    h = two_tiers()
    with SyncBackend(h) as sb:
        top, low, missing = make_key("t"), make_key("l"), make_key("m")
        vt, vl = random_tensor((CHUNK,), torch.uint8, 1), random_tensor((CHUNK,), torch.uint8, 2)
        assert sb.put(top, vt)
        sb.io.run(h.tier("warm").backend.put(low, vl))
        out = torch.empty_like(vt)
        assert sb.get_into(top, out) and same_bits(out, vt)
        assert h.stats()["threadsafe_hits"] == 1
        assert sb.get_into(low, out) and same_bits(out, vl)  # via the loop, then promoted
        assert sb.get_into(missing, out) is False
        assert h.stats()["threadsafe_hits"] == 1
        sb.io.run(h.flush())
        assert sb.get_into(low, out) and same_bits(out, vl)  # promoted: now a fast hit
        assert h.stats()["threadsafe_hits"] == 2
        stats = h.stats()
        assert stats["hits"] == 3 and stats["misses"] == 1
        assert stats["tiers"][0]["hits"] >= 2


def test_batched_get_into_merges_fast_and_slow_results() -> None:
    h = two_tiers()
    with SyncBackend(h) as sb:
        keys = [make_key(f"b{i}") for i in range(4)]
        vals = [random_tensor((CHUNK,), torch.uint8, 10 + i) for i in range(4)]
        sb.put(keys[0], vals[0])
        sb.io.run(h.tier("warm").backend.put(keys[2], vals[2]))
        sb.put(keys[3], vals[3])
        outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in keys]
        assert sb.batched_get_into(keys, outs) == [True, False, True, True]
        for i in (0, 2, 3):
            assert same_bits(outs[i], vals[i])
        assert h.stats()["threadsafe_hits"] == 2
        with pytest.raises(ValueError):
            sb.batched_get_into(keys, outs[:2])


def test_caller_errors_and_closed_backends_still_raise() -> None:
    h = two_tiers()
    sb = SyncBackend(h)
    sb.start()
    key = make_key("e")
    assert sb.put(key, random_tensor((CHUNK,), torch.uint8, 3))
    with pytest.raises(BufferMismatchError):
        sb.get_into(key, torch.empty(CHUNK, dtype=torch.float16))
    with pytest.raises(BufferMismatchError):
        sb.get_into(key, torch.empty(2 * CHUNK, dtype=torch.uint8)[::2])
    sb.io.run(h.close())
    with pytest.raises(BackendClosedError):
        sb.get_into(key, torch.empty(CHUNK, dtype=torch.uint8))
    sb.close()


def test_threads_never_read_a_torn_or_recycled_chunk() -> None:
    """Readers in 4 threads against overwrites, evictions, removals and pins on the loop."""
    h = two_tiers(hot_chunks=6)
    keys = [make_key(f"x{i}") for i in range(12)]
    # two values per key; every byte of a value is the same, so a torn read shows up
    values = {(i, v): torch.full((CHUNK,), i * 2 + v, dtype=torch.uint8)
              for i in range(12) for v in (0, 1)}  # fmt: skip
    stop = threading.Event()
    errors: list[str] = []
    served = [0]

    def reader(seed: int) -> None:
        rnd = random.Random(seed)
        out = torch.empty(CHUNK, dtype=torch.uint8)
        sb = SyncBackend(h, loop_thread=io)
        while not stop.is_set():
            i = rnd.randrange(12)
            res = h.try_get_into_threadsafe(keys[i], out)
            if res is None:
                res = sb.get_into(keys[i], out)
            if res:
                served[0] += 1
                lo, hi = int(out.min()), int(out.max())
                if lo != hi or lo not in (i * 2, i * 2 + 1):
                    errors.append(f"key {i}: bytes {lo}..{hi}")

    sb = SyncBackend(h)
    io = sb.io
    sb.start()
    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()

    async def churn() -> None:
        rnd = random.Random(7)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            await asyncio.sleep(0)  # let the readers' loop-side requests in
            i = rnd.randrange(12)
            op = rnd.random()
            if op < 0.7:
                await h.put(keys[i], values[(i, rnd.randrange(2))])
            elif op < 0.85:
                await h.remove(keys[i])
            else:
                res = await h.lookup_prefix(keys[i : i + 3], lease_s=0.05)
                if rnd.random() < 0.5:
                    await h.release(keys[i : i + res.num_hit])

    try:
        sb.io.run(churn())
    finally:
        stop.set()
        for t in threads:
            t.join()
    sb.close()
    assert not errors, errors[:5]
    assert served[0] > 100
    assert h.tier("hot").backend.stats()["threadsafe_hits"] > 0
