"""The placement policy inside a real hierarchy (cpu backend): admission, chain-aware
victims, the configuration's errors and a plugin's policy through the hook."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "plugin_fixtures"))

from fakedist import fake_entry_point

from lmcache_core import TieredHierarchy
from lmcache_core.backends.host_buffers import ENTRY_OVERHEAD
from lmcache_core.config import load_config
from lmcache_core.errors import ConfigError
from lmcache_core.plugins import BackendRegistry, PluginSettings, load_plugins
from lmcache_core.testing import make_key, random_tensor, run_async

CHUNK = 64 * 1024


def chunk(i: int) -> torch.Tensor:
    return random_tensor((CHUNK,), torch.uint8, seed=i)


def config(chunks: int, placement: Any = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "tiers": [
            {
                "name": "cpu",
                "backend": "cpu",
                "options": {"max_bytes": chunks * (CHUNK + ENTRY_OVERHEAD)},
            }
        ]
    }
    if placement is not None:
        cfg["placement"] = placement
    return cfg


async def resident(h: TieredHierarchy, keys: list[Any], tier: str = "cpu") -> list[bool]:
    return [await h.tier(tier).backend.contains(k) for k in keys]


def test_cost_policy_evicts_a_chain_leaf_where_lru_evicts_its_head() -> None:
    a, b, c, d = (make_key(x) for x in "abcd")

    async def run(placement: Any) -> list[bool]:
        async with TieredHierarchy.from_config(config(3, placement)) as h:
            await h.lookup_prefix([a, b, c])  # learns the chain a -> b -> c
            for i, k in enumerate((a, b, c)):
                assert await h.put(k, chunk(i))
            await h.lookup_prefix([d])
            await h.lookup_prefix([d])  # d has been asked for twice: worth a place
            assert await h.put(d, chunk(3))
            return await resident(h, [a, b, c, d])

    # LRU drops the chain's head: b and c stay but can never be served (a lookup stops at a)
    assert run_async(run(None)) == [False, True, True, True]
    assert run_async(run("lru")) == [False, True, True, True]
    # the cost-aware policy drops the chain's leaf: a -> b still serves two chunks
    assert run_async(run("cost")) == [True, True, False, True]


def test_cost_policy_refuses_a_chunk_whose_parent_is_not_in_the_tier() -> None:
    a, b = make_key("pa"), make_key("pb")

    async def body() -> None:
        async with TieredHierarchy.from_config(config(8, {"policy": "cost"})) as h:
            await h.lookup_prefix([a, b])
            assert not await h.put(b, chunk(1))  # a is not stored: b could never be served
            assert h.tier("cpu").stats.not_admitted == 1
            assert await h.put(a, chunk(0)) and await h.put(b, chunk(1))
            assert (await h.lookup_prefix([a, b])).num_hit == 2

    run_async(body())


def test_the_policy_counts_room_as_the_cpu_tier_charges_it() -> None:
    """The cpu tier charges each entry its buffer plus ENTRY_OVERHEAD: the policy sees the
    same sizes, so it knows the tier is full when the backend is. (Counting value bytes,
    a tier of 80 chunks of 64 KiB looked a chunk larger than it is: the policy admitted
    every newcomer unasked and the backend evicted for it.)"""
    old = [make_key(f"f{i}") for i in range(80)]
    newcomer = make_key("f-new")

    async def body() -> None:
        placement = {"policy": "cost", "options": {"chunk_bytes": CHUNK}}
        async with TieredHierarchy.from_config(config(80, placement)) as h:
            tier = h.tier("cpu")
            assert tier.placement is not None
            assert tier.placement.chunk_bytes == CHUNK + ENTRY_OVERHEAD
            for i, k in enumerate(old):  # one-off chunks, each asked for once
                await h.lookup_prefix([k])
                assert await h.put(k, chunk(i))
            assert tier.placement.policy.info_of(old[0]).nbytes == CHUNK + ENTRY_OVERHEAD
            assert tier.stats.not_admitted == 0
            await h.lookup_prefix([newcomer])
            # full: the newcomer (asked for once) is worth no more than the chunk it
            # would displace, so it is refused and nothing is evicted
            assert not await h.put(newcomer, chunk(80))
            assert tier.stats.not_admitted == 1
            assert await resident(h, old) == [True] * 80

    run_async(body())


def test_an_unknown_policy_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(config(2, {"policy": "cots"}))
    assert info.value.path == "placement.policy"
    assert info.value.reason.startswith(
        "unknown placement policy 'cots' (registered: arc, cost, lru, s3fifo); did you mean 'cost'?"
    )
    with pytest.raises(ConfigError, match=r"unknown option\(s\) for the arc policy: depth"):
        load_config(config(2, {"policy": "arc", "tiers": {"cpu": {"depth": 3}}}))


def test_a_plugin_policy_registered_through_the_hook_runs_the_tier() -> None:
    reg = BackendRegistry()
    load_plugins(
        reg,
        entry_points=[
            fake_entry_point("lmcfix-policy", "lmcfix_policy"),
            fake_entry_point("lmcfix-policy-raises", "lmcfix_policy_raises"),
        ],
        settings=PluginSettings(strict=False),
    )
    assert reg.policy_names() == ["arc", "cost", "lru", "newest-first", "s3fifo"]
    (raised,) = [p for p in reg.plugins if p.name == "lmcfix-policy-raises"]
    assert raised.status == "failed" and "policy hook broke" in raised.error
    assert "fixture-rolled-back" not in reg.names()  # its backend was rolled back too
    keys = [make_key(f"n{i}") for i in range(3)]

    async def body() -> None:
        cfg = load_config(config(2, "newest-first"), registry=reg)
        async with TieredHierarchy(cfg) as h:
            for i, k in enumerate(keys):
                assert await h.put(k, chunk(i))
            assert await resident(h, keys) == [True, False, True]  # the newest went

    run_async(body())


def test_write_through_admits_a_chain_whose_parent_is_still_being_written() -> None:
    """The lower tier's admission of chunk i+1 is asked while chunk i's background store
    may still be queued: the admitted parent counts."""
    keys = [make_key(f"w{i}") for i in range(4)]

    async def body() -> None:
        cfg = config(16, {"policy": "cost"})
        # a second in-memory tier written through (any tier below the top works the same)
        cfg["tiers"].append({"name": "disk", "backend": "cpu", "options": {"max_bytes": 1 << 24}})
        async with TieredHierarchy.from_config(cfg) as h:
            await h.lookup_prefix(keys)
            assert await h.batched_put(keys, [chunk(i) for i in range(4)]) == [True] * 4
            await h.flush()
            assert await resident(h, keys, "disk") == [True] * 4
            assert h.tier("disk").stats.not_admitted == 0

    run_async(body())


def test_sync_callers_lookups_on_the_thread_safe_path_reach_the_policy() -> None:
    """SyncBackend answers lookups from the caller's thread (try_lookup_prefix_threadsafe):
    the policy learns the chain and the accesses there too, and stores take the loop."""
    from lmcache_core import SyncBackend

    a, b, c, d = (make_key(f"s{x}") for x in "abcd")
    with SyncBackend(TieredHierarchy.from_config(config(3, "cost"))) as sb:
        h = sb.backend
        assert isinstance(h, TieredHierarchy)
        assert h.try_lookup_prefix_threadsafe([a, b, c]) is not None  # the fast path answered
        assert sb.batched_put([a, b, c], [chunk(0), chunk(1), chunk(2)]) == [True] * 3
        assert sb.lookup_prefix([d]).num_hit == 0
        assert sb.lookup_prefix([d]).num_hit == 0
        assert sb.put(d, chunk(3))
        assert sb.lookup_prefix([a, b, c]).num_hit == 2  # the leaf c made room, not the head a


def test_cpu_backend_evicts_the_selectors_choice_and_survives_a_failing_selector() -> None:
    from lmcache_core.backends.cpu import CPUBackend

    keys = [make_key(f"v{i}") for i in range(4)]

    async def body() -> None:
        async with CPUBackend({"max_bytes": 3 * (CHUNK + ENTRY_OVERHEAD)}) as be:
            offered: list[bool] = []

            def pick_newest(candidates: Any, nbytes: int) -> list[Any]:
                offered.append(keys[0] in candidates and make_key("zz") not in candidates)
                return [keys[2]]

            be.set_victim_selector(pick_newest)
            for i, k in enumerate(keys[:3]):
                assert await be.put(k, chunk(i))
            assert await be.put(keys[3], chunk(3))
            assert [await be.contains(k) for k in keys] == [True, True, False, True]
            assert offered == [True]

            def broken(candidates: Any, nbytes: int) -> list[Any]:
                raise RuntimeError("a policy bug must not break eviction")

            be.set_victim_selector(broken)
            assert await be.put(keys[2], chunk(2))  # falls back to LRU: keys[0] goes
            assert [await be.contains(k) for k in keys] == [False, True, True, True]

    run_async(body())


def test_observe_prefix_tells_the_policy_the_chain_and_each_access_from_any_thread() -> None:
    """The connector's workers load memory-tier hits without ``lookup_prefix``; they
    report each prompt's chain with ``observe_prefix``: the policy learns the chain
    (a chunk behind a parent it never saw is refused otherwise) and one access per key,
    hit or miss, nothing pinned. Without a policy it is a no-op."""
    import threading

    from lmcache_core.placement import CostAwarePolicy

    keys = [make_key(f"o{i}") for i in range(3)]

    async def body() -> None:
        async with TieredHierarchy.from_config(config(8, {"policy": "cost"})) as h:
            assert h.observes_accesses
            tp = h.tier("cpu").placement
            assert tp is not None
            pol = tp.policy
            assert isinstance(pol, CostAwarePolicy)
            # the chain is unknown: every key looks like a chain's first chunk
            assert h._chains is not None and h._chains.info(keys[2], CHUNK).position == 0
            t = threading.Thread(target=h.observe_prefix, args=(keys,))
            t.start()
            t.join()
            info = h._chains.info(keys[2], CHUNK)
            assert (info.parent, info.position) == (keys[1], 2)
            assert [pol.access_count(k) for k in keys] == [1, 1, 1]
            assert await h.batched_put(keys, [chunk(i) for i in range(3)]) == [True] * 3
            h.observe_prefix(keys)  # now hits: counted, and the policy still sees them resident
            assert [pol.access_count(k) for k in keys] == [2, 2, 2]
            assert all(pol.info_of(k) is not None for k in keys)
            assert h.tier("cpu").stats.pins == 0
        async with TieredHierarchy.from_config(config(8)) as plain:
            assert not plain.observes_accesses
            plain.observe_prefix(keys)  # nothing to tell, nothing raised

    run_async(body())


def test_a_promotion_the_policy_refuses_counts_as_not_admitted() -> None:
    a, b = make_key("qa"), make_key("qb")
    cfg = config(8, {"policy": "cost"})
    cfg["tiers"].append({"name": "low", "backend": "cpu", "options": {"max_bytes": 1 << 24}})

    async def body() -> None:
        async with TieredHierarchy.from_config(cfg) as h:
            await h.lookup_prefix([a, b])  # the policy learns the chain a -> b
            assert await h.tier("low").backend.put(b, chunk(1))  # b only in the lower tier
            out = torch.empty(CHUNK, dtype=torch.uint8)
            assert await h.get_into(b, out)  # served by 'low'; a is not in 'cpu'
            await h.flush()
            assert h.tier("cpu").stats.not_admitted == 1  # the promotion was refused
            assert not await h.tier("cpu").backend.contains(b)

    run_async(body())
