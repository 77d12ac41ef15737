"""Tier policies with real backends: promotion, write-through/back/none, admission,
backpressure, deadlines, failure isolation and recovery, leases, close and flush."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from test_hierarchy_fakes import FlakyBackend, SlowBackend, make_registry

from lmcache_core import TieredHierarchy
from lmcache_core.backends.host_buffers import ENTRY_OVERHEAD
from lmcache_core.testing import make_key, random_tensor, run_async, same_bits

CHUNK = 256 * 1024  # bytes per test chunk


def chunk(i: int) -> torch.Tensor:
    return random_tensor((CHUNK,), torch.uint8, seed=i)


def hierarchy(*tiers: dict[str, Any], **top: Any) -> TieredHierarchy:
    return TieredHierarchy.from_config({"tiers": list(tiers), **top}, registry=make_registry())


def cpu(name: str, chunks: int = 64, **extra: Any) -> dict[str, Any]:
    # each entry also takes ENTRY_OVERHEAD of the bound
    max_bytes = chunks * (CHUNK + ENTRY_OVERHEAD)
    return {"name": name, "backend": "cpu", "options": {"max_bytes": max_bytes}, **extra}


async def in_tier(h: TieredHierarchy, name: str, key: Any) -> bool:
    return bool(await h.tier(name).backend.contains(key))


# ---------------------------------------------------------------------------- promotion
def test_lower_tier_hit_is_served_and_promoted() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot"), cpu("warm")) as h:
            key, value = make_key("p"), chunk(1)
            assert await h.put(key, value)
            await h.flush()
            assert await in_tier(h, "warm", key)  # written through
            await h.tier("hot").backend.remove(key)  # as if evicted
            got = await h.get(key)
            assert same_bits(got, value)
            warm = h.tier("warm").stats
            assert warm.hits == 1
            await h.flush()
            assert await in_tier(h, "hot", key)
            assert h.tier("hot").stats.promotions == 1
            # the next load is served by the top tier
            out = torch.empty_like(value)
            assert await h.get_into(key, out) and same_bits(out, value)
            assert h.tier("hot").stats.hits == 1 and warm.hits == 1

    run_async(body())


def test_get_into_and_batched_loads_promote_too() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot"), cpu("mid"), cpu("cold", write={"policy": "none"})) as h:
            keys = [make_key(f"b{i}") for i in range(4)]
            vals = [chunk(10 + i) for i in range(4)]
            for k, v in zip(keys, vals, strict=True):
                await h.tier("cold").backend.put(k, v)  # only the bottom tier has them
            out = torch.empty_like(vals[0])
            assert await h.get_into(keys[0], out) and same_bits(out, vals[0])
            outs = [torch.empty_like(v) for v in vals[1:]]
            assert await h.batched_get_into(keys[1:], outs) == [True] * 3
            assert all(same_bits(o, v) for o, v in zip(outs, vals[1:], strict=True))
            out.fill_(0)  # the caller reusing its buffer must not affect the promoted copy
            await h.flush()
            for k, v in zip(keys, vals, strict=True):
                # promoted into the top tier and the write-through tier between
                assert same_bits(await h.tier("hot").backend.get(k), v)
                assert same_bits(await h.tier("mid").backend.get(k), v)
            assert h.tier("cold").stats.hits == 4

    run_async(body())


def test_promote_false_leaves_upper_tiers_alone() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot"), cpu("warm", promote=False)) as h:
            key, value = make_key("np"), chunk(2)
            await h.tier("warm").backend.put(key, value)
            assert same_bits(await h.get(key), value)
            await h.flush()
            assert not await in_tier(h, "hot", key)
            assert h.tier("hot").stats.promotions == 0

    run_async(body())


# ---------------------------------------------------------------------------- write policies
def test_write_through_writes_every_store_in_the_background() -> None:
    async def body() -> None:
        h = hierarchy(cpu("hot"), cpu("warm"))
        async with h:
            slow_keys = [make_key(f"wt{i}") for i in range(5)]
            for i, k in enumerate(slow_keys):
                assert await h.put(k, chunk(20 + i))
            await h.flush()
            for i, k in enumerate(slow_keys):
                assert same_bits(await h.tier("warm").backend.get(k), chunk(20 + i))
            assert h.tier("warm").stats.stores == 5
            assert h.tier("warm").stats.bytes_in == 5 * CHUNK

    run_async(body())


def test_write_through_never_waits_for_the_lower_tier() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot"), {"name": "warm", "backend": "slow"}) as h:
            warm = h.tier("warm")
            assert isinstance(warm.backend, SlowBackend)
            warm.backend.hold_puts()  # the lower tier's stores cannot finish meanwhile

            async def three_puts() -> None:
                for i in range(3):
                    assert await h.put(make_key(f"nw{i}"), chunk(i))

            # a put that waited for its store would never return (not a matter of speed)
            await asyncio.wait_for(three_puts(), 30)
            assert warm.writer.depth == 3
            warm.backend.release_puts()
            await h.flush()
            assert warm.stats.stores == 3

    run_async(body())


def test_write_back_writes_on_eviction_only() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot", chunks=3), cpu("warm", write={"policy": "back"})) as h:
            keys = [make_key(f"wb{i}") for i in range(5)]
            for i, k in enumerate(keys):
                assert await h.put(k, chunk(30 + i))
            await h.flush()
            warm = h.tier("warm")
            # the two oldest were evicted from the 3-chunk top tier and written back
            assert [await in_tier(h, "warm", k) for k in keys] == [True, True, False, False, False]
            assert warm.stats.write_backs == 2
            for i in (0, 1):
                assert same_bits(await warm.backend.get(keys[i]), chunk(30 + i))
            # and they are still served (from the warm tier)
            assert same_bits(await h.get(keys[0]), chunk(30))

    run_async(body())


def test_write_back_chain_skips_chunks_the_tier_already_holds() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot", chunks=2), cpu("warm", write={"policy": "back"})) as h:
            keys = [make_key(f"wk{i}") for i in range(3)]
            for i, k in enumerate(keys):
                await h.put(k, chunk(40 + i))
            await h.flush()
            assert h.tier("warm").stats.write_backs == 1  # keys[0] evicted
            assert same_bits(await h.get(keys[0]), chunk(40))  # warm hit, promoted
            await h.flush()  # the promotion evicts keys[1] (written back)
            assert h.tier("warm").stats.write_backs == 2
            await h.put(make_key("wk-x"), chunk(48))  # evicts keys[2]: written back
            await h.put(make_key("wk-y"), chunk(49))  # evicts keys[0]: already in warm
            await h.flush()
            assert h.tier("warm").stats.write_backs == 3
            assert h.tier("warm").stats.known_skips == 1

    run_async(body())


def test_policy_none_is_never_written() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot", chunks=1), cpu("ro", write={"policy": "none"})) as h:
            keys = [make_key(f"n{i}") for i in range(3)]
            for i, k in enumerate(keys):
                await h.put(k, chunk(i))
            await h.flush()
            assert not any([await in_tier(h, "ro", k) for k in keys])
            assert h.tier("ro").stats.stores == 0

    run_async(body())


def test_admit_after_admits_on_the_nth_sighting() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot"), cpu("warm", write={"admit_after": 3})) as h:
            key = make_key("adm")
            for sighting in (1, 2):
                assert await h.put(key, chunk(5))
                await h.flush()
                assert not await in_tier(h, "warm", key), f"admitted at sighting {sighting}"
            assert h.tier("warm").stats.not_admitted == 2
            assert await h.put(key, chunk(5))
            await h.flush()
            assert await in_tier(h, "warm", key)
            other = make_key("adm-other")  # counted per key
            await h.put(other, chunk(6))
            await h.flush()
            assert not await in_tier(h, "warm", other)

    run_async(body())


def test_admit_after_counts_evictions_for_write_back() -> None:
    async def body() -> None:
        tiers = (cpu("hot", chunks=1), cpu("warm", write={"policy": "back", "admit_after": 2}))
        async with hierarchy(*tiers) as h:
            a, b = make_key("ea"), make_key("eb")
            await h.put(a, chunk(1))
            await h.put(b, chunk(2))  # evicts a: first sighting, not admitted
            await h.flush()
            assert not await in_tier(h, "warm", a)
            await h.put(a, chunk(1))  # evicts b (first sighting of b)
            await h.put(b, chunk(2))  # evicts a: second sighting -> written back
            await h.flush()
            assert await in_tier(h, "warm", a)
            assert not await in_tier(h, "warm", b)

    run_async(body())


# ---------------------------------------------------------------------------- backpressure
def test_backpressure_drops_and_counts_stores_never_loads() -> None:
    async def body() -> None:
        gated = {"name": "warm", "backend": "slow", "max_queue": 2, "write_concurrency": 1}
        async with hierarchy(cpu("hot"), gated) as h:
            warm = h.tier("warm")
            assert isinstance(warm.backend, SlowBackend)
            preloaded = make_key("pre")
            await warm.backend.put(preloaded, chunk(99))
            warm.backend.hold_puts()
            keys = [make_key(f"bp{i}") for i in range(6)]
            t0 = time.perf_counter()
            for i, k in enumerate(keys):
                assert await h.put(k, chunk(50 + i))  # the caller is never held up
            assert time.perf_counter() - t0 < 1.0
            assert warm.writer.depth == 2
            assert warm.stats.dropped_stores == 4
            assert warm.stats.dropped_by_reason == {"queue_full": 4}
            # loads are not queued behind stores: both tiers serve while stores are stuck
            assert same_bits(await h.get(keys[5]), chunk(55))
            assert same_bits(await h.get(preloaded), chunk(99))
            warm.backend.release_puts()
            await h.flush()
            assert [await in_tier(h, "warm", k) for k in keys] == [True, True] + [False] * 4
            assert h.stats()["tiers"][1]["dropped_stores"] == 4

    run_async(body())


def test_backpressure_by_queue_latency() -> None:
    async def body() -> None:
        tier = {"name": "warm", "backend": "slow", "write_concurrency": 1,
                "max_queue_latency_ms": 50}  # fmt: skip
        async with hierarchy(cpu("hot"), tier) as h:
            warm = h.tier("warm")
            warm.backend.hold_puts()
            await h.put(make_key("l0"), chunk(0))  # running (held)
            await h.put(make_key("l1"), chunk(1))  # queued
            await asyncio.sleep(0.12)
            await h.put(make_key("l2"), chunk(2))  # the oldest queued waited > 50 ms
            assert warm.stats.dropped_by_reason == {"queue_latency": 1}
            warm.backend.release_puts()
            await h.flush()
            assert warm.stats.stores == 2
            await h.put(make_key("l3"), chunk(3))  # queue drained: accepted again
            await h.flush()
            assert warm.stats.stores == 3

    run_async(body())


def test_a_promotion_listener_hears_whether_the_top_tier_stored_the_chunk() -> None:
    """``promote(on_top_stored=fn)`` when the top tier's store fails: ``fn(False)``, and
    nothing is in the tier; once the tier works again, ``fn(True)`` with the chunk there."""

    async def body() -> None:
        flaky = {"name": "hot", "backend": "flaky", "options": {"max_bytes": "64MiB"},
                 "retry_backoff_ms": 20}  # fmt: skip
        async with hierarchy(flaky, cpu("warm")) as h:
            hot = h.tier("hot").backend
            key, value = make_key("pl"), chunk(21)
            await h.tier("warm").backend.put(key, value)
            heard: list[bool] = []
            for failing in (True, False):
                out = torch.empty_like(value)
                hit, promote = await h.get_into_deferred(key, out)
                assert hit and same_bits(out, value) and promote is not None
                hot.failing = failing  # (the store fails, not the load)
                await promote(on_top_stored=heard.append)
                await h.flush()
                hot.failing = False
                assert await in_tier(h, "hot", key) is (not failing)
                await asyncio.sleep(0.1)  # (past the failed tier's back-off)
            assert heard == [False, True]

    run_async(body())


# ---------------------------------------------------------------------------- deadlines
def test_load_deadline_turns_a_slow_tier_into_misses() -> None:
    async def body() -> None:
        slow = {"name": "warm", "backend": "slow", "options": {"load_delay_ms": 1500},
                "load_deadline_ms": 50}  # fmt: skip
        async with hierarchy(cpu("hot"), slow) as h:
            warm = h.tier("warm")
            key, value = make_key("dl"), chunk(7)
            await warm.backend.put(key, value)
            t0 = time.perf_counter()
            assert await h.get(key) is None
            out = torch.zeros_like(value)
            assert await h.get_into(key, out) is False
            assert await h.batched_get_into([key], [out]) == [False]
            elapsed = time.perf_counter() - t0
            # three 50 ms deadlines; one load left to run its 1.5 s would pass 1.2 s
            # (room for a loaded machine without letting an unenforced deadline through)
            assert elapsed < 1.2, f"three 50 ms deadlines took {elapsed:.3f} s"
            assert warm.stats.timeouts == 3
            # the abandoned loads finish later and must never touch the caller's buffer
            deadline = time.monotonic() + 5
            while warm.backend.loads_finished < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert warm.backend.loads_finished == 3
            await asyncio.sleep(0.05)
            assert torch.count_nonzero(out) == 0
            # within the deadline the same tier serves
            warm.backend.load_delay_s = 0.0
            assert await h.get_into(key, out) and same_bits(out, value)

    run_async(body())


def test_lookup_deadline_skips_a_slow_tier() -> None:
    async def body() -> None:
        slow = {"name": "warm", "backend": "slow", "options": {"lookup_delay_ms": 500},
                "lookup_deadline_ms": 30}  # fmt: skip
        async with hierarchy(cpu("hot"), slow) as h:
            keys = [make_key(f"ld{i}") for i in range(4)]
            await h.put(keys[0], chunk(0))
            await h.flush()
            await h.tier("warm").backend.put(keys[1], chunk(1))
            t0 = time.perf_counter()
            res = await h.lookup_prefix(keys)
            assert time.perf_counter() - t0 < 0.4
            assert res.num_hit == 1 and res.skipped == ("warm",)
            assert h.tier("warm").stats.timeouts == 1
            h.tier("warm").backend.lookup_delay_s = 0.0
            res = await h.lookup_prefix(keys)
            assert res.num_hit == 2 and res.tiers == (0, 1) and res.skipped == ()

    run_async(body())


# ---------------------------------------------------------------------------- failures
def test_a_raising_tier_becomes_misses_and_recovers() -> None:
    async def body() -> None:
        flaky = {"name": "warm", "backend": "flaky", "options": {"max_bytes": "64MiB"},
                 "retry_backoff_ms": 100}  # fmt: skip
        async with hierarchy(cpu("hot", chunks=1), flaky) as h:
            warm = h.tier("warm")
            assert isinstance(warm.backend, FlakyBackend)
            a, b = make_key("fa"), make_key("fb")
            await h.put(a, chunk(1))
            await h.flush()
            await h.put(b, chunk(2))  # evicts a from the 1-chunk top tier
            await h.flush()
            warm.backend.failing = True
            # every path is a miss, never an exception
            assert await h.get(a) is None
            assert warm.stats.errors == 1
            assert warm.health.state == "backoff"
            calls = warm.backend.calls
            assert await h.get_into(a, torch.empty(CHUNK, dtype=torch.uint8)) is False
            assert (await h.lookup_prefix([b, a])).num_hit == 1
            assert await h.contains(a) is False
            assert warm.backend.calls == calls, "a tier in backoff must not be called"
            assert await h.put(make_key("fc"), chunk(3))  # top tier still works
            assert warm.stats.dropped_by_reason.get("tier_failing", 0) == 1
            # after the backoff a retry happens; still failing -> longer backoff
            await asyncio.sleep(0.15)
            assert await h.get(a) is None
            assert warm.stats.errors == 2 and warm.health.consecutive_errors == 2
            # the tier recovers: the next retry after the backoff serves again
            warm.backend.failing = False
            await asyncio.sleep(0.25)
            assert same_bits(await h.get(a), chunk(1))
            assert warm.health.state == "ok" and warm.health.recoveries == 1

    run_async(body())


def test_a_raising_top_tier_never_raises_to_the_caller() -> None:
    async def body() -> None:
        top = {"name": "hot", "backend": "flaky", "options": {"max_bytes": "64MiB"}}
        async with hierarchy(top, cpu("warm")) as h:
            key = make_key("ft")
            h.tier("hot").backend.failing = True
            assert await h.put(key, chunk(4)) is False  # not in the top tier ...
            await h.flush()
            assert same_bits(await h.get(key), chunk(4))  # ... but written through
            assert h.tier("hot").stats.errors >= 1
            assert await h.batched_contains([key]) == [True]

    run_async(body())


def test_cancellation_and_keyboard_interrupt_propagate() -> None:
    async def body() -> None:
        slow = {"name": "warm", "backend": "slow", "options": {"load_delay_ms": 2000}}
        async with hierarchy(cpu("hot"), slow) as h:
            key = make_key("cx")
            await h.tier("warm").backend.put(key, chunk(1))
            task = asyncio.ensure_future(h.get(key))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert h.tier("warm").stats.errors == 0
        flaky = {"name": "hot", "backend": "flaky", "options": {"max_bytes": "8MiB"}}
        async with hierarchy(flaky) as h2:
            h2.tier("hot").backend.raise_base = KeyboardInterrupt
            with pytest.raises(KeyboardInterrupt):
                await h2.get(make_key("ki"))
            h2.tier("hot").backend.raise_base = None

    run_async(body())


def test_a_tier_failing_to_start_is_retried() -> None:
    async def body() -> None:
        h = hierarchy(cpu("hot"), {"name": "warm", "backend": "flaky", "retry_backoff_ms": 50})
        warm = h.tier("warm").backend
        real_start = warm._start
        attempts = 0

        async def failing_start() -> None:
            nonlocal attempts
            attempts += 1
            if attempts == 1:
                raise OSError("not reachable yet")
            await real_start()

        warm._start = failing_start  # type: ignore[method-assign]
        async with h:
            key = make_key("st")
            assert await h.put(key, chunk(1))
            assert h.tier("warm").stats.dropped_by_reason == {"tier_failing": 1}
            await asyncio.sleep(0.08)
            assert await h.put(key, chunk(1))
            await h.flush()
            assert attempts == 2 and await warm.contains(key)

    run_async(body())


# ---------------------------------------------------------------------------- lookups
def test_lookup_prefix_reports_where_each_chunk_is() -> None:
    async def body() -> None:
        tiers = (cpu("hot"), cpu("warm", write={"policy": "none"}),
                 cpu("cold", write={"policy": "none"}))  # fmt: skip
        async with hierarchy(*tiers) as h:
            keys = [make_key(f"lp{i}") for i in range(10)]
            place = {0: "hot", 1: "hot", 2: "warm", 3: "cold", 4: "hot", 5: "warm",
                     6: "cold", 8: "hot", 9: "hot"}  # fmt: skip
            for i, name in place.items():
                await h.tier(name).backend.put(keys[i], chunk(i))
            await h.tier("cold").backend.put(keys[0], chunk(0))  # the fastest copy counts
            res = await h.lookup_prefix(keys)
            assert res.num_hit == 7
            assert res.tiers == (0, 0, 1, 2, 0, 1, 2)
            assert res.tier_of(3) == "cold"
            assert res.counts() == {"hot": 3, "warm": 2, "cold": 2}
            assert (await h.lookup_prefix(keys[7:])).num_hit == 0
            assert (await h.lookup_prefix([])).num_hit == 0
            # each tier was asked once, only about what the tiers above lacked
            assert h.tier("hot").stats.lookup_keys == 10 + 3
            assert h.tier("warm").stats.lookup_keys == 5 + 1
            assert h.tier("cold").stats.lookup_keys == 3 + 1

    run_async(body())


def test_pending_background_store_still_serves_the_chunk() -> None:
    async def body() -> None:
        warm = {"name": "warm", "backend": "slow", "write_concurrency": 1}
        async with hierarchy(cpu("hot", chunks=1), warm) as h:
            h.tier("warm").backend.hold_puts()
            a, b = make_key("pa"), make_key("pb")
            await h.put(a, chunk(1))
            await h.put(b, chunk(2))  # evicts a from the top tier; a's store is held
            assert not await in_tier(h, "hot", a)
            assert (await h.lookup_prefix([a])).num_hit == 1
            assert same_bits(await h.get(a), chunk(1))
            h.tier("warm").backend.release_puts()
            await h.flush()

    run_async(body())


# ---------------------------------------------------------------------------- leases
def test_leased_chunks_survive_eviction_until_released() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot", chunks=3)) as h:
            keys = [make_key(f"ls{i}") for i in range(3)]
            for i, k in enumerate(keys):
                await h.put(k, chunk(i))
            res = await h.lookup_prefix(keys, lease_s=30)
            assert res.num_hit == 3 and res.leased == 3
            # pinned: new stores cannot evict them (they are refused instead)
            assert await h.put(make_key("ls-new"), chunk(9)) is False
            assert all([await in_tier(h, "hot", k) for k in keys])
            assert await h.release(keys[:2]) == 2
            assert await h.put(make_key("ls-new2"), chunk(8))
            assert not await in_tier(h, "hot", keys[0])
            assert await in_tier(h, "hot", keys[2])  # still leased
            assert h.stats()["leases"] == 1
        assert await h.release(keys) == 0  # closed: every lease ended, no error

    run_async(body())


def test_leases_expire() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot", chunks=2)) as h:
            keys = [make_key(f"le{i}") for i in range(2)]
            for i, k in enumerate(keys):
                await h.put(k, chunk(i))
            assert (await h.lookup_prefix(keys, lease_s=0.1)).leased == 2
            assert await h.put(make_key("le-x"), chunk(5)) is False
            await asyncio.sleep(0.3)
            assert h.stats()["leases"] == 0
            assert await h.put(make_key("le-y"), chunk(6))

    run_async(body())


def test_lookup_beyond_the_prefix_pins_nothing() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot", chunks=4)) as h:
            keys = [make_key(f"lb{i}") for i in range(4)]
            for i in (0, 2, 3):
                await h.put(keys[i], chunk(i))
            res = await h.lookup_prefix(keys, lease_s=30)
            assert res.num_hit == 1 and res.leased == 1
            assert h.tier("hot").backend.stats()["pinned_entries"] == 1

    run_async(body())


# ---------------------------------------------------------------------------- remove, close
def test_remove_is_not_undone_by_a_pending_store() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot"), {"name": "warm", "backend": "slow"}) as h:
            warm = h.tier("warm").backend
            warm.hold_puts()
            queued, running = make_key("rq"), make_key("rr")
            await h.put(running, chunk(1))
            await asyncio.sleep(0.01)  # its store is now running (held)
            await h.put(queued, chunk(2))
            assert await h.remove(queued)
            removal = asyncio.ensure_future(h.remove(running))
            await asyncio.sleep(0.05)
            assert not removal.done()  # waits for the running store of that key
            warm.release_puts()
            assert await removal
            await h.flush()
            assert not await h.contains(queued) and not await h.contains(running)

    run_async(body())


def test_close_drains_pending_stores() -> None:
    async def body() -> None:
        h = hierarchy(cpu("hot"), {"name": "warm", "backend": "slow",
                                   "options": {"put_delay_ms": 50}})  # fmt: skip
        await h.start()
        for i in range(4):
            await h.put(make_key(f"cd{i}"), chunk(i))
        await h.close()
        assert h.tier("warm").stats.stores == 4
        assert h.tier("warm").stats.dropped_stores == 0

    run_async(body())


def test_close_cancels_what_does_not_drain_in_time() -> None:
    async def body() -> None:
        h = hierarchy(cpu("hot"), {"name": "warm", "backend": "slow", "write_concurrency": 1},
                      drain_timeout_s=0.1)  # fmt: skip
        await h.start()
        h.tier("warm").backend.hold_puts()
        for i in range(3):
            await h.put(make_key(f"cc{i}"), chunk(i))
        t0 = time.perf_counter()
        await h.close()
        assert time.perf_counter() - t0 < 2.0
        assert h.tier("warm").stats.dropped_by_reason == {"closed": 3}
        assert h.tier("warm").stats.stores == 0

    run_async(body())


# ---------------------------------------------------------------------------- zero copy
def test_write_back_takes_the_evicted_buffer_without_copying() -> None:
    async def body() -> None:
        async with hierarchy(cpu("hot", chunks=1), cpu("warm", write={"policy": "back"})) as h:
            hot, warm = h.tier("hot").backend, h.tier("warm").backend
            a, b = make_key("za"), make_key("zb")
            await h.put(a, chunk(1))
            ptr = hot._entries[a].buf.data_ptr()
            await h.put(b, chunk(2))  # evicts a: its buffer moves down as is
            await h.flush()
            assert warm._entries[a].buf.data_ptr() == ptr
            assert same_bits(await warm.get(a), chunk(1))
            assert hot.stats()["recycled_bytes"] == 0  # the hot tier let go of it
            assert hot.stats()["data_bytes"] == CHUNK
            await h.put(make_key("zc"), chunk(3))  # the hot tier reuses no taken memory
            assert same_bits(await warm.get(a), chunk(1))

    run_async(body())


def test_cpu_eviction_listener_may_take_the_tensor() -> None:
    from lmcache_core import CPUBackend

    async def body() -> None:
        b = CPUBackend({"max_bytes": 2 * CHUNK})
        taken: dict[Any, torch.Tensor] = {}

        def listener(key: Any, value: torch.Tensor) -> bool:
            if len(taken) == 0:
                taken[key] = value  # keep the first evicted tensor
                return True
            return False  # the second is copied by nobody: recycled

        b.set_eviction_listener(listener)
        await b.start()
        keys = [make_key(f"ev{i}") for i in range(4)]
        for i, k in enumerate(keys):
            await b.put(k, chunk(i))
        assert list(taken) == [keys[0]]
        assert b.stats()["used_bytes"] <= 2 * CHUNK
        for i in range(4, 8):  # churn: the taken tensor is never reused
            await b.put(make_key(f"ev{i}"), chunk(i))
        assert same_bits(taken[keys[0]], chunk(0))
        await b.close()

    run_async(body())
