"""SyncBackend's thread-safe fast paths: lookups, leases and stores answered in the caller's
thread (cpu backend, hierarchy), their agreement with the async path, and their safety
while the event loop overwrites, evicts, removes and pins at the same time."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_hierarchy_fakes import make_registry

from lmcache_core import (
    BackendClosedError,
    BackendNotStartedError,
    CPUBackend,
    SyncBackend,
    TieredHierarchy,
)
from lmcache_core.backends.host_buffers import ENTRY_OVERHEAD
from lmcache_core.testing import make_key, random_tensor, same_bits

CHUNK = 16 * 1024


def hierarchy(*tiers: tuple[str, str, int, str]) -> TieredHierarchy:
    """Tiers as (name, backend, capacity in chunks, write policy)."""
    return TieredHierarchy.from_config(
        {
            "tiers": [
                {
                    "name": name,
                    "backend": backend,
                    "options": {"max_bytes": chunks * (CHUNK + ENTRY_OVERHEAD)},
                    **({"write": {"policy": policy}} if i else {}),
                }
                for i, (name, backend, chunks, policy) in enumerate(tiers)
            ]
        },
        registry=make_registry(),
    )


def in_thread(fn: Callable[[], Any], timeout: float = 10.0) -> Any:
    """Run ``fn`` in a fresh plain thread; return its result (raise if it did not finish)."""
    box: list[Any] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            box.append(fn())
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=body)
    th.start()
    th.join(timeout)
    if th.is_alive():
        raise AssertionError("the call did not finish: it waited for the blocked loop")
    if errors:
        raise errors[0]
    return box[0]


class BlockedLoop:
    """Keeps the IO loop busy (blocked in a callback) while the body runs."""

    def __init__(self, sb: SyncBackend) -> None:
        self.sb = sb
        self.release = threading.Event()
        self.entered = threading.Event()

    def __enter__(self) -> BlockedLoop:
        def block() -> None:
            self.entered.set()
            self.release.wait(30)

        self.sb.io.loop.call_soon_threadsafe(block)
        assert self.entered.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()


# --------------------------------------------------------------------------- no loop needed
def test_cpu_backend_answers_lookups_and_stores_without_its_loop() -> None:
    with SyncBackend(CPUBackend({"max_bytes": 64 * CHUNK})) as sb:
        keys = [make_key(f"c{i}") for i in range(8)]
        vals = [random_tensor((CHUNK // 2,), torch.float16, seed=i) for i in range(8)]
        with BlockedLoop(sb):
            assert in_thread(lambda: sb.put(keys[0], vals[0])) is True
            assert in_thread(lambda: sb.batched_put(keys[1:4], vals[1:4])) == [True] * 3
            assert in_thread(lambda: sb.contains(keys[0])) is True
            assert in_thread(lambda: sb.contains(keys[5])) is False
            assert in_thread(lambda: sb.batched_contains(keys)) == [True] * 4 + [False] * 4
            out = torch.empty_like(vals[2])
            assert in_thread(lambda: sb.get_into(keys[2], out)) is True
            assert same_bits(out, vals[2])
        got = sb.get(keys[3])  # the async path sees what the threads stored
        assert same_bits(got, vals[3])
        st = sb.stats()
        assert st["puts"] == 4 and st["entries"] == 4
        assert st["bytes_written"] == 4 * CHUNK


def test_hierarchy_answers_lookups_and_leases_without_its_loop() -> None:
    h = hierarchy(("hot", "cpu", 16, ""), ("warm", "cpu", 64, "through"))
    with SyncBackend(h) as sb:
        keys = [make_key(f"h{i}") for i in range(6)]
        for i, k in enumerate(keys[:4]):
            tier = h.tier("hot" if i < 2 else "warm").backend
            sb.io.run(tier.put(k, random_tensor((CHUNK,), torch.uint8, seed=i)))
        with BlockedLoop(sb):
            res = in_thread(lambda: sb.lookup_prefix(keys, lease_s=30))
            assert res.num_hit == 4 and res.leased == 4
            assert [res.tier_of(i) for i in range(4)] == ["hot", "hot", "warm", "warm"]
            assert in_thread(lambda: sb.batched_contains(keys)) == [True] * 4 + [False] * 2
            assert in_thread(lambda: sb.contains(keys[3])) is True
            assert h.tier("hot").backend.stats()["pinned_entries"] == 2
            assert in_thread(lambda: sb.release(keys)) == 4
        assert h.tier("hot").backend.stats()["pinned_entries"] == 0
        assert h.tier("warm").backend.stats()["pinned_entries"] == 0
        st = h.stats()
        assert st["threadsafe_lookups"] == 1 and st["leases"] == 0
        assert st["tiers"][0]["lookup_keys"] >= 6 and st["tiers"][0]["pins"] == 2


def test_single_tier_hierarchy_stores_without_its_loop() -> None:
    h = hierarchy(("hot", "cpu", 16, ""))
    with SyncBackend(h) as sb:
        k, v = make_key("p"), random_tensor((CHUNK,), torch.uint8, seed=3)
        with BlockedLoop(sb):
            assert in_thread(lambda: sb.put(k, v)) is True
        assert same_bits(sb.get(k), v)
        st = h.stats()
        assert st["puts"] == 1 and st["tiers"][0]["stores"] == 1


def test_stores_that_feed_lower_tiers_take_the_loop() -> None:
    """With a write-through tier below, a put must queue the background store: the loop
    does it (so the lower tier receives the chunk)."""
    h = hierarchy(("hot", "cpu", 16, ""), ("warm", "cpu", 64, "through"))
    with SyncBackend(h) as sb:
        k, v = make_key("w"), random_tensor((CHUNK,), torch.uint8, seed=4)
        assert sb.put(k, v)
        sb.io.run(h.flush())
        assert same_bits(sb.io.run(h.tier("warm").backend.get(k)), v)


# --------------------------------------------------------------------------- agreement
def test_lookup_prefix_agrees_with_the_async_path() -> None:
    rnd = random.Random(11)
    h = hierarchy(("a", "cpu", 64, ""), ("b", "cpu", 64, "none"), ("c", "cpu", 64, "none"))
    with SyncBackend(h) as sb:
        keys = [make_key(f"a{i}") for i in range(40)]
        small = torch.zeros(8, dtype=torch.uint8)
        for k in keys:
            where = rnd.choice(["a", "b", "c", None, None])
            if where is not None:
                sb.io.run(h.tier(where).backend.put(k, small))
        for _ in range(30):
            lo = rnd.randrange(40)
            sub = keys[lo : lo + rnd.randrange(1, 12)]
            expect = sb.io.run(h.lookup_prefix(sub))
            got = sb.lookup_prefix(sub)
            assert (got.num_hit, got.tiers) == (expect.num_hit, expect.tiers)
            leased = sb.lookup_prefix(sub, lease_s=30)
            assert (leased.num_hit, leased.tiers) == (expect.num_hit, expect.tiers)
            assert leased.leased == expect.num_hit
            assert sb.release(sub[: leased.num_hit]) == expect.num_hit
            assert sb.batched_contains(sub) == sb.io.run(h.batched_contains(sub))
        assert len(h.leases) == 0
        assert all(t.backend.stats()["pinned_entries"] == 0 for t in h.tiers)


def test_a_tier_without_fast_paths_sends_the_rest_to_the_loop() -> None:
    """A lower tier that cannot answer from a thread (``slow``): the top tier answers what
    it holds, the loop answers the rest, and leased lookups go through the loop whole."""
    h = hierarchy(("hot", "cpu", 16, ""), ("cold", "slow", 64, "through"))
    slow = h.tier("cold").backend
    slow.try_batched_contains_threadsafe = None  # declare: not answerable from a thread
    with SyncBackend(h) as sb:
        top, low, none = make_key("t"), make_key("l"), make_key("n")
        sb.io.run(h.tier("hot").backend.put(top, torch.ones(4)))
        sb.io.run(slow.put(low, torch.ones(4)))
        assert sb.batched_contains([top, low, none]) == [True, True, False]
        assert sb.contains(low) and not sb.contains(none)
        res = sb.lookup_prefix([top, low, none], lease_s=30)
        assert res.num_hit == 2 and res.leased == 2  # taken on the loop: slow pins there
        assert h.stats()["threadsafe_lookups"] == 0
        assert sb.release([top, low]) == 2
        assert slow.stats()["pinned_entries"] == 0


def test_batched_put_keeps_the_order_of_duplicates_across_both_paths() -> None:
    with SyncBackend(CPUBackend({"max_bytes": 64 * CHUNK})) as sb:
        k = make_key("d")
        plain = torch.full((64,), 1, dtype=torch.int32)
        strided = torch.full((128,), 2, dtype=torch.int32)[::2]  # not contiguous: async path
        assert sb.batched_put([k, k], [plain, strided]) == [True, True]
        assert int(sb.get(k)[0]) == 2  # type: ignore[index]
        assert sb.batched_put([k, k], [strided, plain]) == [True, True]
        assert int(sb.get(k)[0]) == 1  # type: ignore[index]


def test_errors_of_the_async_path_still_reach_the_caller() -> None:
    b = CPUBackend({"max_bytes": 64 * CHUNK})
    sb = SyncBackend(b)
    with pytest.raises(BackendNotStartedError):
        sb.contains(make_key("x"))
    with pytest.raises(BackendNotStartedError):
        sb.put(make_key("x"), torch.ones(2))
    sb.start()
    with pytest.raises(TypeError):
        sb.batched_contains(["not a key"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        sb.lookup_prefix([make_key("x")])  # a bare backend has no lookup_prefix
    assert sb.put(make_key("big"), torch.ones(64 * CHUNK + 1, dtype=torch.uint8)) is False
    assert sb.stats()["rejected_puts"] == 1
    sb.io.run(b.close())
    with pytest.raises(BackendClosedError):
        sb.contains(make_key("x"))
    with pytest.raises(BackendClosedError):
        sb.batched_put([make_key("x")], [torch.ones(2)])
    sb.close()


def test_a_lease_taken_from_a_thread_expires() -> None:
    h = hierarchy(("hot", "cpu", 16, ""))
    with SyncBackend(h) as sb:
        k = make_key("e")
        sb.put(k, torch.ones(16))
        for _ in range(2):  # the sweeper stops when no lease is left, then starts again
            assert sb.lookup_prefix([k], lease_s=0.05).leased == 1
            assert h.tier("hot").backend.stats()["pinned_entries"] == 1
            deadline = time.monotonic() + 5
            while len(h.leases) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(h.leases) == 0
            assert h.tier("hot").backend.stats()["pinned_entries"] == 0
        assert h.leases.expired == 2


def test_ending_a_lease_ends_the_one_on_the_oldest_entry_whatever_the_order_leases_were_taken() -> (
    None
):
    """Two lookups from different threads can pin two entries of one key (an overwrite in
    between) and record their leases in either order. A release must end the lease on the
    older entry: ending the newer one would leave the other caller's hit evictable (seen
    as 'leased key missed before its release' under 4 threads)."""
    h = hierarchy(("hot", "cpu", 2, ""))
    sb = SyncBackend(h)
    sb.start()
    try:
        top: Any = h.tiers[0].backend
        k, other = make_key("lease-k"), make_key("lease-other")
        v0, v1 = (
            torch.full((CHUNK,), 1, dtype=torch.uint8),
            torch.full((CHUNK,), 2, dtype=torch.uint8),
        )
        assert sb.put(k, v0)
        sb.io.run(h.flush())
        (old,) = top.pin_many([k])  # caller A's pin, taken first ...
        assert sb.put(k, v1)
        sb.io.run(h.flush())
        (new,) = top.pin_many([k])  # ... caller B's pin on the overwrite
        assert old is not None and new is not None and old is not new
        assert old.pin_order < new.pin_order
        far = time.monotonic() + 60
        h.leases.add_many([(k, (0, far, new))])  # B records its lease first
        h.leases.add_many([(k, (0, far, old))])
        assert sb.release([k]) == 1  # A is done
        assert h.leases.pop_all() == [(0, far, new)]  # B's lease is the one left
        top.unpin_many([new])  # (pop_all does not unpin)
        # deeper tiers end first, whatever the entry age
        h.leases.add_many([(other, (0, far, new)), (other, (1, far, object()))])
        assert h.leases.release([other])[0][0] == 1
        h.leases.pop_all()
    finally:
        sb.close()


# --------------------------------------------------------------------------- concurrency
def _uniform_values(n: int) -> dict[tuple[int, int], torch.Tensor]:
    # two values per key, every byte of a value the same: a torn or foreign read shows up
    return {(i, v): torch.full((CHUNK,), i * 2 + v, dtype=torch.uint8)
            for i in range(n) for v in (0, 1)}  # fmt: skip


def _run_workers_during(
    sb: SyncBackend, worker: Callable[[int], None], stop: threading.Event, churn: Any
) -> None:
    """Run ``worker(seed)`` in 4 threads while ``churn`` runs on the loop; stop and join them."""
    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    try:
        sb.io.run(churn)
    finally:
        stop.set()
        for t in threads:
            t.join()


def _check_accounting(b: CPUBackend) -> None:
    st = b.stats()
    entries = list(b._entries.values())
    assert st["pinned_entries"] == 0
    assert all(e.users == 0 for e in entries)
    assert st["used_bytes"] == sum(e.mem.cost for e in entries)  # overhead included
    assert st["data_bytes"] == sum(e.nbytes for e in entries)
    assert st["used_bytes"] + st["recycled_bytes"] <= b.max_bytes


@pytest.mark.parametrize("lower", ["none", "through", "back"])
def test_threads_hammer_the_fast_paths_while_the_loop_churns(lower: str) -> None:
    """4 threads store, load, look up, lease and release through the fast paths while the
    loop overwrites, evicts and removes: every byte served is right, every leased hit
    stays loadable until its release, and the cpu tier's accounting ends consistent."""
    n = 12
    tiers: list[tuple[str, str, int, str]] = [("hot", "cpu", 6, "")]
    if lower != "none":
        tiers.append(("warm", "cpu", 64, lower))
    h = hierarchy(*tiers)
    keys = [make_key(f"z{i}") for i in range(n)]
    values = _uniform_values(n)
    stop = threading.Event()
    errors: list[str] = []
    counts = {"loads": 0, "leases": 0, "puts": 0, "leased_loads": 0}
    # A pin holds the entry it found: an explicit remove, or an overwrite (a new entry
    # that is not pinned, and can then be evicted), ends the promise. Count them per key
    # where they happen, in the top tier itself (a hierarchy store lands there later, from
    # its queue), so a miss with an unchanged count is a broken promise.
    replaced = [0] * n
    index_of = {k: i for i, k in enumerate(keys)}
    sb = SyncBackend(h)
    sb.start()
    top: Any = h.tiers[0].backend
    install, remove = top._install, top._remove

    def counted_install(key: Any, entry: Any) -> None:
        with top._lock:
            replaced[index_of[key]] += 1
            install(key, entry)

    async def counted_remove(key: Any) -> bool:
        # counted and done under one hold of the (re-entrant) lock, as in counted_install:
        # a lookup between the count and the removal would see the count and then lose
        # its pin's entry (the cpu tier's _remove never suspends, so holding it is safe)
        with top._lock:
            replaced[index_of[key]] += 1
            return bool(await remove(key))

    top._install, top._remove = counted_install, counted_remove

    def check(i: int, out: torch.Tensor, what: str) -> None:
        lo, hi = int(out.min()), int(out.max())
        if lo != hi or lo not in (i * 2, i * 2 + 1):
            errors.append(f"{what} key {i}: bytes {lo}..{hi}")

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        out = torch.empty(CHUNK, dtype=torch.uint8)
        try:
            while not stop.is_set():
                op = rnd.random()
                i = rnd.randrange(n)
                if op < 0.3:
                    if sb.put(keys[i], values[(i, rnd.randrange(2))]):
                        counts["puts"] += 1
                elif op < 0.5:
                    if sb.get_into(keys[i], out):
                        counts["loads"] += 1
                        check(i, out, "load")
                elif op < 0.65:
                    present = sb.batched_contains(keys)
                    if len(present) != n:
                        errors.append("batched_contains lost keys")
                else:
                    lo = rnd.randrange(n - 3)
                    sub = keys[lo : lo + 4]
                    replaced_before = replaced[lo : lo + 4]
                    res = sb.lookup_prefix(sub, lease_s=30)
                    counts["leases"] += res.leased
                    # A hit still queued for the tier is found, not pinned: check the pinned.
                    assert res.leased == sum(res.pinned) and len(res.pinned) == res.num_hit
                    for j in range(res.num_hit):
                        if not res.pinned[j] or res.tier_of(j) != "hot":
                            continue  # only the hot tier pins; others are not promised
                        if not sb.get_into(sub[j], out):
                            if replaced[lo + j] == replaced_before[j]:
                                errors.append(f"leased key {lo + j} missed before its release")
                        else:
                            counts["leased_loads"] += 1
                            check(lo + j, out, "leased load")
                    # end only this lookup's leases (a hit still queued is found, not pinned)
                    sb.release([k for k, p in zip(sub, res.pinned, strict=False) if p])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    async def churn() -> None:
        rnd = random.Random(7)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            await asyncio.sleep(0)  # let the workers' loop-side requests in
            i = rnd.randrange(n)
            if rnd.random() < 0.8:
                await h.put(keys[i], values[(i, rnd.randrange(2))])
            else:
                await h.remove(keys[i])

    _run_workers_during(sb, worker, stop, churn())
    try:
        sb.io.run(h.flush())
        assert not errors, errors[:5]
        assert counts["loads"] > 20 and counts["leases"] > 20 and counts["puts"] > 20
        assert counts["leased_loads"] > 20
        assert len(h.leases) == 0
        for t in h.tiers:
            _check_accounting(t.backend)
        st = h.stats()
        assert st["threadsafe_lookups"] > 0
        if lower == "none":
            assert st["tiers"][0]["stores"] >= counts["puts"]
        # whatever is stored now is one of its key's two values
        out = torch.empty(CHUNK, dtype=torch.uint8)
        for i, k in enumerate(keys):
            if sb.get_into(k, out):
                check(i, out, "final")
        assert not errors, errors[:5]
    finally:
        sb.close()


def test_bare_cpu_backend_under_threads_and_loop_eviction() -> None:
    """Threads put and read through the bare cpu backend's fast paths while the loop puts
    and removes; a 6-chunk capacity makes nearly every put evict."""
    n = 10
    b = CPUBackend({"max_bytes": 6 * CHUNK})
    keys = [make_key(f"y{i}") for i in range(n)]
    values = _uniform_values(n)
    stop = threading.Event()
    errors: list[str] = []
    sb = SyncBackend(b)
    sb.start()

    def worker(seed: int) -> None:
        rnd = random.Random(seed)
        out = torch.empty(CHUNK, dtype=torch.uint8)
        while not stop.is_set():
            i = rnd.randrange(n)
            if rnd.random() < 0.5:
                sb.batched_put([keys[i]], [values[(i, rnd.randrange(2))]])
            elif sb.get_into(keys[i], out):
                lo, hi = int(out.min()), int(out.max())
                if lo != hi or lo not in (i * 2, i * 2 + 1):
                    errors.append(f"key {i}: bytes {lo}..{hi}")
            if b.stats()["used_bytes"] > b.max_bytes:
                errors.append("over capacity")

    async def churn() -> None:
        rnd = random.Random(3)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            await asyncio.sleep(0)
            i = rnd.randrange(n)
            if rnd.random() < 0.7:
                await b.put(keys[i], values[(i, rnd.randrange(2))])
            else:
                await b.remove(keys[i])

    _run_workers_during(sb, worker, stop, churn())
    try:
        assert not errors, errors[:5]
        _check_accounting(b)
        assert b.stats()["evictions"] > 0
    finally:
        sb.close()


class _RacingIndex(OrderedDict):  # type: ignore[type-arg]
    """An index whose first ``get`` of ``victim`` starts ``racer`` in another thread and
    waits up to 0.3 s for it: the window between finding an entry and referencing it."""

    victim: Any = None
    racer: Callable[[], None] | None = None
    thread: threading.Thread | None = None

    def get(self, key: Any, default: Any = None) -> Any:
        found = super().get(key, default)
        if key == self.victim and self.racer is not None:
            self.thread = threading.Thread(target=self.racer)
            self.racer = None
            self.thread.start()
            self.thread.join(0.3)  # with the lookup under the backend lock, the racer waits
        return found


def test_a_load_racing_an_overwrite_from_another_thread_never_recycles_a_buffer_twice() -> None:
    """A loop-side load finds an entry while another thread overwrites its key (which
    releases the entry): the buffer must be neither recycled while it is read nor recycled
    twice (two later stores would then share it and serve each other's bytes)."""
    b = CPUBackend({"max_bytes": 8 * CHUNK})
    sb = SyncBackend(b)
    sb.start()
    try:
        keys = [make_key(f"race{i}") for i in range(3)]
        values = _uniform_values(3)
        for i, k in enumerate(keys):
            assert sb.put(k, values[(i, 0)])
        index = _RacingIndex(b._entries)
        b._entries = index
        index.victim = keys[0]
        index.racer = lambda: b.try_batched_put_threadsafe([keys[0]], [values[(0, 1)]])
        out = torch.empty(CHUNK, dtype=torch.uint8)
        assert sb.io.run(b.get_into(keys[0], out))  # on the loop, not a thread fast path
        assert int(out.min()) == int(out.max()) == 0
        assert index.thread is not None
        index.thread.join(5)
        # new stores must get distinct buffers, and every value stays its own
        fresh = [make_key(f"fresh{i}") for i in range(3)]
        for j, k in enumerate(fresh):
            assert sb.put(k, values[(j, 1)].clone().fill_(100 + j))
        ptrs = [e.buf.data_ptr() for e in b._entries.values()]
        assert len(ptrs) == len(set(ptrs)), "two entries share one buffer"
        expected = [(keys[0], 1), (keys[1], 2), (keys[2], 4)]
        expected += [(k, 100 + j) for j, k in enumerate(fresh)]
        for k, want in expected:
            assert sb.get_into(k, out)
            assert int(out.min()) == int(out.max()) == want
    finally:
        sb.close()
