"""The backend contract suite.

Every backend (first-party, third-party and the tiered hierarchy) subclasses these
classes in its tests and provides one fixture, ``backend_factory``: a callable that
returns a new, *unstarted* backend. Within one test, every call returns a backend over
the same storage, empty at the start of the test (so persistence and sharing can be
checked by calling it twice). Keyword arguments override options (the capacity tests
pass ``max_bytes=...``)::

    from lmcache_core.testing import BackendContract, PersistentContract

    class TestMyBackend(BackendContract, PersistentContract):
        @pytest.fixture
        def backend_factory(self, tmp_path):
            return lambda **opts: MyBackend({"path": str(tmp_path), **opts})

Which mixins apply follows the backend's :class:`~lmcache_core.Capabilities`:
``BackendContract`` always; ``PersistentContract`` when ``persistent``;
``SharedContract`` when ``shared``; ``CapacityContract`` when ``bounded``. A test in
``BackendContract`` fails when a declared capability's mixin is missing.

Mixins for persistent and shared stores that need one more fixture each:
``CorruptionContract`` (``corrupt_entry``: damaged objects are misses),
``NamespaceContract`` (``namespace_factory``: namespaces are isolated) and
``ProcessContract`` (``backend_spec``: sharing between processes, a writer killed
mid-put).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest
import torch

from ..backend import StorageBackend
from ..errors import BackendClosedError, BufferMismatchError, LMCacheError
from ..keys import CacheEngineKey, Namespace

__all__ = [
    "BackendContract",
    "CapacityContract",
    "CorruptionContract",
    "NamespaceContract",
    "PersistentContract",
    "ProcessContract",
    "SharedContract",
    "make_key",
    "random_tensor",
    "run_async",
    "same_bits",
]

T = TypeVar("T")
Factory = Callable[..., StorageBackend]
MiB = 1 << 20


def run_async(coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
    """Run ``coro`` in a fresh event loop with a timeout (tests are synchronous)."""

    async def guarded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


_counter = 0


def make_key(
    tag: str = "", model: str = "contract-model", dtype: str = "float16"
) -> CacheEngineKey:
    """A fresh, unique key."""
    global _counter
    _counter += 1
    h = int.from_bytes(
        f"{tag}:{_counter}:{time.perf_counter_ns()}".encode()[:32].ljust(16, b"\0"), "big"
    )
    return CacheEngineKey(model, 1, 0, h % (1 << 128), dtype)


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype = torch.float16, seed: int = 0
) -> torch.Tensor:
    """Random bits of any dtype (floats include NaN/inf patterns: compare with :func:`same_bits`)."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit-exact equality (dtype, shape and bytes; NaNs compare equal to themselves)."""
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


#: The most of another thread's wait for a CPU that one heartbeat beat may discount (see
#: ``BackendContract.test_event_loop_is_not_blocked``): a GIL holder preempted by another
#: process waits about one scheduler period, far less; a loop blocked for longer than this
#: plus the test's 20 ms margin fails even on a loaded machine.
_OTHER_WAIT_CAP_S = 0.050


class _CpuWaits:
    """Per-thread CPU time and waits for a CPU (runnable, not running) of this process:
    the first two fields of Linux's ``/proc/self/task/<tid>/schedstat``, in ns. Made on
    the event-loop thread, which it tells apart. Where the files are missing nothing is
    known and :meth:`excused` is zero."""

    def __init__(self) -> None:
        self._me = str(threading.get_native_id())
        self._fds: dict[str, int] = {}
        try:
            self._cpus = max(1, len(os.sched_getaffinity(0)))
        except (AttributeError, OSError):
            self._cpus = max(1, os.cpu_count() or 1)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return {}
        out: dict[str, tuple[int, int]] = {}
        for tid in tids:
            fd = self._fds.get(tid)
            try:
                if fd is None:
                    path = f"/proc/self/task/{tid}/schedstat"
                    fd = self._fds[tid] = os.open(path, os.O_RDONLY)
                fields = os.pread(fd, 128, 0).split()
                out[tid] = (int(fields[0]), int(fields[1]))
            except (OSError, ValueError, IndexError):  # the thread ended
                if fd is not None:
                    os.close(self._fds.pop(tid))
        return out

    def excused(
        self, before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]
    ) -> float:
        """Seconds between two snapshots that the loop surely lost to *other processes*
        taking the CPUs: the loop thread's wait for a CPU, and the longest wait of another
        thread (which may hold the GIL the loop needs; at most :data:`_OTHER_WAIT_CAP_S`),
        each less what this process's other threads ran meanwhile, spread over the CPUs
        (a CPU they held is not one another process took from the loop)."""
        me = self._me
        ran = 0
        own_wait = longest = 0
        for tid, (cpu, wait) in after.items():
            cpu0, wait0 = before.get(tid, (0, 0))
            if tid == me:
                own_wait = wait - wait0
            else:
                ran += cpu - cpu0
                longest = max(longest, wait - wait0)
        ours = ran / self._cpus
        other = min(max(0.0, longest - ours) / 1e9, _OTHER_WAIT_CAP_S)
        return max(0.0, own_wait - ours) / 1e9 + other

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


async def _started(factory: Factory, **opts: Any) -> StorageBackend:
    backend = factory(**opts)
    await backend.start()
    return backend


class _Base:
    """Shared helpers."""

    #: Size of the large values used by the concurrency and heartbeat tests.
    big_bytes: int = 4 * MiB

    def run(self, fn: Callable[[], Awaitable[T]], timeout: float = 120.0) -> T:
        async def body() -> T:
            return await fn()

        return run_async(body(), timeout)


class BackendContract(_Base):
    """Behaviour every backend must show."""

    DTYPES = (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int64,
        torch.bool,
    )
    SHAPES = ((), (0,), (1,), (3, 5, 7), (2, 1, 3, 1), (4096,))

    def test_declared_capabilities_are_tested(self, backend_factory: Factory) -> None:
        caps = backend_factory().capabilities
        missing = [
            mixin.__name__
            for flag, mixin in (
                (caps.persistent, PersistentContract),
                (caps.shared, SharedContract),
                (caps.bounded, CapacityContract),
            )
            if flag and not isinstance(self, mixin)
        ]
        assert not missing, f"capabilities declared but contract mixins not used: {missing}"

    def test_round_trip_is_bit_exact(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                cases = []
                for i, dtype in enumerate(self.DTYPES):
                    for j, shape in enumerate(self.SHAPES):
                        cases.append(
                            (make_key(f"rt{i}-{j}"), random_tensor(shape, dtype, seed=i * 31 + j))
                        )
                for key, value in cases:
                    assert await b.put(key, value)
                for key, value in cases:
                    got = await b.get(key)
                    assert same_bits(got, value), (
                        f"get mismatch for {value.dtype}{list(value.shape)}"
                    )
                    out = torch.empty(value.shape, dtype=value.dtype)
                    assert await b.get_into(key, out)
                    assert same_bits(out, value)
            finally:
                await b.close()

        self.run(body)

    def test_non_contiguous_value_is_stored_by_value(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                base = random_tensor((8, 6), torch.float32, seed=3)
                value = base.t()
                key = make_key("nc")
                assert await b.put(key, value)
                assert same_bits(await b.get(key), value.contiguous())
            finally:
                await b.close()

        self.run(body)

    def test_missing_key_semantics(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                key = make_key("missing")
                assert await b.get(key) is None
                assert await b.get_into(key, torch.empty(4)) is False
                assert await b.contains(key) is False
                assert await b.remove(key) is False
                assert await b.batched_get([key, key]) == [None, None]
                assert await b.batched_contains([key]) == [False]
            finally:
                await b.close()

        self.run(body)

    def test_overwrite_and_remove(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                key = make_key("ow")
                v1, v2 = random_tensor((64,), seed=1), random_tensor((64,), seed=2)
                assert await b.put(key, v1)
                assert await b.put(key, v1)  # idempotent
                assert same_bits(await b.get(key), v1)
                assert await b.put(key, v2)
                assert same_bits(await b.get(key), v2)
                assert await b.contains(key)
                assert await b.remove(key) is True
                assert await b.get(key) is None
                assert await b.contains(key) is False
            finally:
                await b.close()

        self.run(body)

    def test_borrowed_views_stay_intact_until_returned(self, backend_factory: Factory) -> None:
        """Backends with ``ThreadSafeBorrows``: a borrowed view holds the stored bytes
        while the key is overwritten (same size: the case an in-place copy would take)
        and removed; an absent key borrows ``None``."""
        from ..interface import ThreadSafeBorrows, implements

        async def body() -> None:
            b = await _started(backend_factory)
            lender: object = b
            try:
                if not implements(lender, ThreadSafeBorrows):
                    return
                key = make_key("borrow")
                v1, v2 = random_tensor((4096,), seed=1), random_tensor((4096,), seed=2)
                assert await b.put(key, v1)
                res = lender.try_borrow_threadsafe([key, make_key("borrow-absent")])
                assert res is not None and res[1] is None and res[0] is not None
                handle, view = res[0]
                assert same_bits(view, v1)
                assert await b.put(key, v2)
                assert same_bits(await b.get(key), v2)
                await b.remove(key)
                assert same_bits(view, v1), "a borrowed view changed before its borrow ended"
                lender.end_borrows([handle])
            finally:
                await b.close()

        self.run(body)

    def test_batch_order_with_duplicates(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                keys = [make_key(f"b{i}") for i in range(5)]
                vals = [random_tensor((17, i + 1), seed=i) for i in range(5)]
                assert await b.batched_put(keys, vals) == [True] * 5
                missing = make_key("bmiss")
                order = [keys[3], missing, keys[0], keys[3], keys[4]]
                got = await b.batched_get(order)
                expect = [vals[3], None, vals[0], vals[3], vals[4]]
                assert all(same_bits(g, e) for g, e in zip(got, expect, strict=True))
                assert await b.batched_contains(order) == [True, False, True, True, True]
                outs = [torch.empty_like(e) if e is not None else torch.empty(1) for e in expect]
                hits = await b.batched_get_into(order, outs)
                assert hits == [True, False, True, True, True]
                for h, o, e in zip(hits, outs, expect, strict=True):
                    if h:
                        assert same_bits(o, e)
                # a duplicated key in one batched_put: the last value wins
                dup = make_key("bdup")
                assert all(await b.batched_put([dup, dup], [vals[0], vals[1][:17, :1]]))
                assert same_bits(await b.get(dup), vals[1][:17, :1].contiguous())
            finally:
                await b.close()

        self.run(body)

    def test_ownership(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                key = make_key("own")
                value = random_tensor((256,), torch.float32, seed=5)
                keep = value.clone()
                assert await b.put(key, value)
                value.fill_(1.0)  # mutating the caller's tensor after put changes nothing stored
                got = await b.get(key)
                assert same_bits(got, keep)
                assert got is not None
                got.fill_(2.0)  # mutating a returned tensor changes nothing stored
                again = await b.get(key)
                assert same_bits(again, keep)
                assert again is not None and again.data_ptr() != got.data_ptr()
                out = torch.empty_like(keep)
                assert await b.get_into(key, out)
                out.fill_(3.0)
                assert same_bits(await b.get(key), keep)
            finally:
                await b.close()

        self.run(body)

    def test_donated_value_round_trips(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                key = make_key("donate")
                value = random_tensor((1024,), torch.float16, seed=8)
                keep = value.clone()
                assert await b.put(key, value, donate=True)
                assert same_bits(await b.get(key), keep)
            finally:
                await b.close()

        self.run(body)

    def test_get_into_semantics(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                key = make_key("gi")
                value = random_tensor((4, 8), torch.float16, seed=9)
                assert await b.put(key, value)
                out = torch.full((4, 8), 7.0, dtype=torch.float16)
                assert await b.get_into(key, out) is True
                assert same_bits(out, value)
                with pytest.raises(BufferMismatchError):
                    await b.get_into(key, torch.empty((4, 8), dtype=torch.float32))
                with pytest.raises(BufferMismatchError):
                    await b.get_into(key, torch.empty((8, 4), dtype=torch.float16))
                with pytest.raises(BufferMismatchError):
                    await b.get_into(key, torch.empty((8, 4), dtype=torch.float16).t())
                with pytest.raises(TypeError):
                    await b.get_into(key, "not a tensor")  # type: ignore[arg-type]
                # the stored value survives the refused calls
                assert same_bits(await b.get(key), value)
            finally:
                await b.close()

        self.run(body)

    def test_bad_arguments_raise_and_lose_nothing(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                key = make_key("bad")
                value = random_tensor((16,), seed=10)
                assert await b.put(key, value)
                with pytest.raises(TypeError):
                    await b.put("not-a-key", value)  # type: ignore[arg-type]
                with pytest.raises(TypeError):
                    await b.put(key, [1, 2, 3])  # type: ignore[arg-type]
                with pytest.raises(ValueError):
                    await b.batched_put([key], [])
                assert same_bits(await b.get(key), value)
            finally:
                await b.close()

        self.run(body)

    def test_start_and_close_are_idempotent(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = backend_factory()
            with pytest.raises(LMCacheError):
                await b.get(make_key("early"))
            await b.start()
            await b.start()
            key = make_key("life")
            assert await b.put(key, random_tensor((8,)))
            await b.close()
            await b.close()
            with pytest.raises(BackendClosedError):
                await b.get(key)
            with pytest.raises(BackendClosedError):
                await b.put(key, random_tensor((8,)))
            with pytest.raises(BackendClosedError):
                await b.batched_contains([key])

        self.run(body)

    def test_concurrent_puts_and_gets(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                n = 16
                keys = [make_key(f"cc{i}") for i in range(n)]
                vals = [random_tensor((256 * 1024,), torch.uint8, seed=100 + i) for i in range(n)]
                assert all(
                    await asyncio.gather(*(b.put(k, v) for k, v in zip(keys, vals, strict=True)))
                )
                newer = [random_tensor((256 * 1024,), torch.uint8, seed=200 + i) for i in range(n)]

                async def reader(i: int) -> bool:
                    got = await b.get(keys[i])
                    return same_bits(got, vals[i]) or same_bits(got, newer[i])

                tasks: list[Awaitable[Any]] = []
                for i in range(n):
                    tasks.append(reader(i))
                    tasks.append(b.put(keys[i], newer[i]))
                    tasks.append(reader(i))
                results = await asyncio.gather(*tasks)
                assert all(results)
                for i in range(n):
                    assert same_bits(await b.get(keys[i]), newer[i])
            finally:
                await b.close()

        self.run(body)

    def test_cancelled_put_leaves_old_or_new(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                key = make_key("cancel")
                old = random_tensor((self.big_bytes,), torch.uint8, seed=1)
                new = random_tensor((self.big_bytes,), torch.uint8, seed=2)
                for delay in (0.0, 0.0001, 0.0005, 0.001, 0.003, 0.01):
                    assert await b.put(key, old)
                    task = asyncio.ensure_future(b.put(key, new))
                    await asyncio.sleep(delay)
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
                    got = await b.get(key)
                    assert same_bits(got, old) or same_bits(got, new), (
                        f"torn value after cancel at {delay}s"
                    )
            finally:
                await b.close()

        self.run(body)

    def test_event_loop_is_not_blocked(self, backend_factory: Factory) -> None:
        """16 concurrent puts of big values leave the event loop responsive: a 1 ms
        heartbeat's 99th-percentile lag stays within 20 ms of its idle one.

        The lag counts what the backend can cause (the loop thread busy, asleep in a call
        that blocks, or kept off the CPUs by the backend's own threads) and not what other
        processes on a loaded machine do: the time the loop thread waited for a CPU, and
        (up to 50 ms a beat) the longest such wait of another thread of the process, which
        may hold the GIL the loop needs, are taken off, less the CPU time the process's
        other threads had meanwhile (the kernel's per-thread counts, Linux; plain
        wall-clock lag elsewhere).
        """

        async def heartbeat(stop: asyncio.Event, lags: list[float]) -> None:
            period = 0.001
            waits = _CpuWaits()
            try:
                while not stop.is_set():
                    w0 = waits.snapshot()
                    t0 = time.perf_counter()
                    await asyncio.sleep(period)
                    t1 = time.perf_counter()
                    lag = t1 - t0 - period - waits.excused(w0, waits.snapshot())
                    lags.append(max(0.0, lag))
            finally:
                waits.close()

        async def measure(work: Callable[[], Awaitable[Any]] | None, seconds: float) -> float:
            """The heartbeat's p99 lag while ``work`` runs (or for ``seconds``)."""
            stop = asyncio.Event()
            lags: list[float] = []
            hb = asyncio.ensure_future(heartbeat(stop, lags))
            await asyncio.sleep(0.01)
            if work is None:
                await asyncio.sleep(seconds)
            else:
                await work()
            stop.set()
            await hb
            lags.sort()
            return lags[int(0.99 * (len(lags) - 1))] if lags else 0.0

        async def body() -> None:
            b = await _started(backend_factory)
            try:
                vals = [random_tensor((self.big_bytes,), torch.uint8, seed=i) for i in range(16)]
                keys = [make_key(f"hb{i}") for i in range(16)]

                async def work() -> None:
                    # rounds of 16 concurrent puts for >= 0.5 s, so p99 rests on many samples
                    t_end = time.perf_counter() + 0.5
                    while time.perf_counter() < t_end:
                        await asyncio.gather(
                            *(b.put(k, v) for k, v in zip(keys, vals, strict=True))
                        )

                # The cyclic GC can pause a big test process for tens of ms; that is not the
                # backend blocking the loop, so both phases run with it off.
                # A shared, loaded machine can still delay the whole process now and then;
                # a backend that really blocks the loop fails every attempt, so the best of
                # three is judged.
                attempts: list[tuple[float, float]] = []
                gc.collect()
                gc.disable()
                try:
                    for _ in range(3):
                        idle = await measure(None, 0.5)
                        busy = await measure(work, 0.0)
                        attempts.append((busy, idle))
                        if busy < 0.020 + idle:
                            break
                finally:
                    gc.enable()
                ms = [(round(x * 1e3, 1), round(y * 1e3, 1)) for x, y in attempts]
                # judged by the best attempt's margin (busy - idle), the same quantity
                # the loop stops on: the smallest busy lag alone may be an attempt that
                # failed while a later one passed
                busy, idle = min(attempts, key=lambda a: a[0] - a[1])
                assert busy < 0.020 + idle, (
                    f"event loop blocked: heartbeat p99 lag {busy * 1e3:.1f} ms under 16 concurrent "
                    f"{self.big_bytes >> 20} MiB puts (idle p99 {idle * 1e3:.1f} ms; every "
                    f"attempt's (busy, idle) p99 in ms: {ms})"
                )
            finally:
                await b.close()

        self.run(body)

    def test_stats_count_hits_and_misses(self, backend_factory: Factory) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                before = b.stats()
                key = make_key("st")
                await b.put(key, random_tensor((8,)))
                await b.get(key)
                await b.get(make_key("st-miss"))
                after = b.stats()
                assert after["hits"] >= before["hits"] + 1
                assert after["misses"] >= before["misses"] + 1
            finally:
                await b.close()

        self.run(body)


class PersistentContract(_Base):
    """For backends declaring ``persistent``: data survives close and reopen."""

    def test_persists_across_reopen(self, backend_factory: Factory) -> None:
        async def body() -> None:
            keys = [make_key(f"p{i}") for i in range(4)]
            vals = [random_tensor((33, i + 1), torch.bfloat16, seed=i) for i in range(4)]
            b = await _started(backend_factory)
            assert await b.batched_put(keys, vals) == [True] * 4
            assert await b.remove(keys[3])
            await b.put(keys[2], vals[0])
            await b.close()
            b2 = await _started(backend_factory)
            try:
                assert same_bits(await b2.get(keys[0]), vals[0])
                assert same_bits(await b2.get(keys[1]), vals[1])
                assert same_bits(await b2.get(keys[2]), vals[0])
                assert await b2.get(keys[3]) is None
            finally:
                await b2.close()

        self.run(body)


class SharedContract(_Base):
    """For backends declaring ``shared``: two open instances see each other's data."""

    def test_two_instances_share_data(self, backend_factory: Factory) -> None:
        async def body() -> None:
            a = await _started(backend_factory)
            b = await _started(backend_factory)
            try:
                key = make_key("sh")
                value = random_tensor((1000,), torch.float16, seed=12)
                assert await a.put(key, value)
                assert await b.contains(key)
                assert same_bits(await b.get(key), value)
                assert await b.remove(key)
                assert await a.get(key) is None
            finally:
                await a.close()
                await b.close()

        self.run(body)


class CapacityContract(_Base):
    """For backends declaring ``bounded``: ``max_bytes`` is honoured."""

    capacity_option = "max_bytes"

    def _used(self, backend: StorageBackend) -> int | None:
        used = backend.stats().get("used_bytes")
        return int(used) if used is not None else None

    def test_capacity_bound_is_honoured(self, backend_factory: Factory) -> None:
        async def body() -> None:
            cap = 1 * MiB
            b = await _started(backend_factory, **{self.capacity_option: cap})
            try:
                keys = [make_key(f"cap{i}") for i in range(12)]
                vals = [random_tensor((256 * 1024,), torch.uint8, seed=i) for i in range(12)]
                for k, v in zip(keys, vals, strict=True):
                    await b.put(k, v)
                    used = self._used(b)
                    if used is not None:
                        assert used <= cap, f"used_bytes {used} exceeds max_bytes {cap}"
                present = [await b.contains(k) for k in keys]
                assert sum(present) <= cap // (256 * 1024)
                assert present[-1], "the most recent put must be stored"
                assert same_bits(await b.get(keys[-1]), vals[-1])
                # a value larger than the whole capacity is refused softly
                assert (
                    await b.put(make_key("huge"), torch.zeros(2 * cap, dtype=torch.uint8)) is False
                )
                assert same_bits(await b.get(keys[-1]), vals[-1])
            finally:
                await b.close()

        self.run(body)

    def test_recently_used_entries_survive_eviction(self, backend_factory: Factory) -> None:
        async def body() -> None:
            cap = 1 * MiB
            b = await _started(backend_factory, **{self.capacity_option: cap})
            try:
                chunk = 256 * 1024
                first = make_key("lru-first")
                v = random_tensor((chunk,), torch.uint8, seed=1)
                assert await b.put(first, v)
                for i in range(8):
                    assert same_bits(await b.get(first), v)  # keeps it most recently used
                    await b.put(
                        make_key(f"lru{i}"), random_tensor((chunk,), torch.uint8, seed=i + 2)
                    )
                assert same_bits(await b.get(first), v), "the hottest entry was evicted"
            finally:
                await b.close()

        self.run(body)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class CorruptionContract(_Base):
    """For persistent backends: a damaged object is a miss, never wrong data or an error.

    Needs the fixture ``corrupt_entry``: ``corrupt_entry(backend, key, kind)`` (sync or
    async) damages the stored object of ``key`` on the medium itself, where ``kind`` is
    ``"flip"`` (one byte of the tensor data changed), ``"truncate"`` (the object cut
    short) or ``"foreign"`` (replaced by a valid object of another key).
    :func:`lmcache_core.testing.blob.corrupt_blob` does it for every byte-store backend.
    """

    CORRUPTIONS = ("flip", "truncate", "foreign")

    def test_damaged_objects_are_misses(
        self, backend_factory: Factory, corrupt_entry: Callable[..., Any]
    ) -> None:
        async def body() -> None:
            b = await _started(backend_factory)
            try:
                for i, kind in enumerate(self.CORRUPTIONS):
                    key = make_key(f"corrupt-{kind}")
                    value = random_tensor((8192,), torch.float16, seed=40 + i)
                    for read in ("get", "get_into", "batched_get_into"):
                        assert await b.put(key, value)
                        await _maybe_await(corrupt_entry(b, key, kind))
                        misses = b.stats()["misses"]
                        out = torch.empty_like(value)
                        if read == "get":
                            assert await b.get(key) is None, f"{kind} object served by get"
                        elif read == "get_into":
                            assert await b.get_into(key, out) is False, f"{kind} object served"
                        else:
                            assert await b.batched_get_into([key], [out]) == [False]
                        assert b.stats()["misses"] > misses
                        # a fresh put of the key is stored and served again
                        assert await b.put(key, value)
                        assert same_bits(await b.get(key), value)
            finally:
                await b.close()

        self.run(body)


class NamespaceContract(_Base):
    """For backends that store a namespace: one namespace never sees another's objects.

    Needs the fixture ``namespace_factory``: ``namespace_factory(namespace)`` returns a
    new, unstarted backend over the same storage as ``backend_factory``, opened with
    that :class:`~lmcache_core.Namespace`.
    """

    def test_namespaces_are_isolated(self, namespace_factory: Callable[[Namespace], Any]) -> None:
        async def body() -> None:
            a = namespace_factory(Namespace(model_name="contract-a", chunk_size=64))
            b = namespace_factory(Namespace(model_name="contract-b", chunk_size=64))
            await a.start()
            await b.start()
            try:
                key = make_key("ns")
                va = random_tensor((512,), torch.float16, seed=51)
                vb = random_tensor((512,), torch.float16, seed=52)
                assert await a.put(key, va)
                assert await b.get(key) is None
                assert await b.contains(key) is False
                assert await b.get_into(key, torch.empty_like(va)) is False
                assert await b.put(key, vb)
                assert same_bits(await a.get(key), va)
                assert same_bits(await b.get(key), vb)
                assert await b.remove(key)
                assert same_bits(await a.get(key), va)
            finally:
                await a.close()
                await b.close()

        self.run(body)


def _child(spec: dict[str, Any], mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "lmcache_core.testing.worker", json.dumps(spec), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 120.0) -> int:
    try:
        _out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("contract worker process did not finish") from None
    if proc.returncode not in (0, 3):
        raise AssertionError(f"contract worker failed (rc={proc.returncode}):\n{err[-3000:]}")
    return proc.returncode


class ProcessContract(_Base):
    """For ``shared`` persistent backends: other processes see the data, and a writer
    killed mid-put leaves every object old, new or absent, never partial.

    Needs the fixture ``backend_spec``: a JSON-able dict that a child process turns into
    a backend over the same storage as ``backend_factory``
    (``{"target": "pkg.module:Class", "options": {...}}``, optionally ``"namespace"``
    JSON and ``"name"``; see :mod:`lmcache_core.testing.worker`).
    """

    #: How many times a writer is killed mid-run.
    kill_rounds = 2

    def test_two_processes_share_data(
        self, backend_factory: Factory, backend_spec: dict[str, Any]
    ) -> None:
        from .worker import shared_key, shared_value

        assert _finish(_child(backend_spec, "put")) == 0

        async def body() -> None:
            b = await _started(backend_factory)
            try:
                for i in range(4):
                    assert same_bits(await b.get(shared_key(i)), shared_value(i)), i
                assert await b.put(shared_key(4), shared_value(4))
            finally:
                await b.close()

        self.run(body)
        assert _finish(_child(backend_spec, "check")) == 0, "the other process missed key 4"

    def test_writer_killed_mid_put_leaves_no_partial_object(
        self, backend_factory: Factory, backend_spec: dict[str, Any]
    ) -> None:
        from ..interface import EntryChecks, MaintainableBackend, implements
        from .worker import killed_writer_candidates, shared_key

        rng = random.Random(7)
        for _ in range(self.kill_rounds):
            proc = _child(backend_spec, "forever")
            try:
                assert proc.stdout is not None
                line = proc.stdout.readline()
                assert line.strip() == "ready", f"writer did not start: {proc.stderr}"
                time.sleep(rng.uniform(0.05, 0.4))
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.communicate()

        async def body() -> None:
            b = await _started(backend_factory)
            try:
                for j in range(4):
                    got = await b.get(shared_key(j, "killed"))
                    assert got is None or any(
                        same_bits(got, c) for c in killed_writer_candidates(j)
                    ), f"key {j}: a partial or mixed object was served"
                if implements(b, MaintainableBackend):
                    async for e in b.scan():
                        if implements(b, EntryChecks):
                            why = await b.check_entry(e)
                            assert why in (None, "missing"), f"{e.location}: {why}"
                        else:
                            assert await b.verify_entry(e), e.location
            finally:
                await b.close()

        self.run(body)
