"""The hierarchy's eviction event: any number of subscribers, write-back still served
through the same event, and per-key pin flags of leased lookups."""

from __future__ import annotations

from typing import Any

import torch
from test_hierarchy_fakes import make_registry

from lmcache_core import TieredHierarchy
from lmcache_core.backends.host_buffers import ENTRY_OVERHEAD
from lmcache_core.testing import make_key, random_tensor, run_async, same_bits

CHUNK = 64 * 1024


def chunk(i: int) -> torch.Tensor:
    return random_tensor((CHUNK,), torch.uint8, seed=i)


def cpu(name: str, chunks: int, **extra: Any) -> dict[str, Any]:
    opts = {"max_bytes": chunks * (CHUNK + ENTRY_OVERHEAD)}  # each entry is charged its overhead
    return {"name": name, "backend": "cpu", "options": opts, **extra}


def test_every_subscriber_sees_each_eviction_and_write_back_still_works() -> None:
    async def body() -> None:
        cfg = {"tiers": [cpu("hot", 2), cpu("warm", 2, write={"policy": "back"})]}
        async with TieredHierarchy.from_config(cfg, registry=make_registry()) as h:
            seen_a: list[tuple[str, Any]] = []
            seen_b: list[tuple[str, Any]] = []
            h.add_eviction_listener(lambda t, k: seen_a.append((t, k)))
            unsubscribe = h.add_eviction_listener(lambda t, k: seen_b.append((t, k)))

            def broken(t: str, k: Any) -> None:
                raise RuntimeError("a subscriber failing must not break eviction")

            h.add_eviction_listener(broken)
            keys = [make_key(f"ev{i}") for i in range(5)]
            for i, k in enumerate(keys[:3]):
                assert await h.put(k, chunk(i))
            await h.flush()
            assert seen_a == seen_b == [("hot", keys[0])]
            # write-back took the evicted chunk: it is served from the warm tier
            assert h.tier("warm").stats.write_backs == 1
            assert same_bits(await h.tier("warm").backend.get(keys[0]), chunk(0))
            unsubscribe()
            unsubscribe()  # idempotent
            for i, k in enumerate(keys[3:], start=3):
                assert await h.put(k, chunk(i))
            await h.flush()
            hot = [k for t, k in seen_a if t == "hot"]
            assert hot == keys[:3]
            assert len(seen_b) == 1
            # the warm tier (2 chunks) evicted too: reported with its own name
            assert any(t == "warm" for t, _ in seen_a)

    run_async(body())


def test_leased_lookup_says_which_hits_are_pinned() -> None:
    async def body() -> None:
        cfg = {"tiers": [cpu("hot", 4)]}
        async with TieredHierarchy.from_config(cfg, registry=make_registry()) as h:
            keys = [make_key(f"pn{i}") for i in range(3)]
            for i, k in enumerate(keys[:2]):
                await h.put(k, chunk(i))
            res = await h.lookup_prefix(keys, lease_s=10)
            assert res.num_hit == 2 and res.pinned == (True, True) and res.leased == 2
            assert (await h.lookup_prefix(keys)).pinned == ()
            assert await h.release(keys[:2]) == 2

    run_async(body())
