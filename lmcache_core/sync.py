"""Calling async backends from synchronous code (vLLM's scheduler and worker threads).

:class:`IOLoopThread` runs one asyncio event loop in a daemon thread; :class:`SyncBackend`
wraps any :class:`~lmcache_core.StorageBackend` and runs each call as a coroutine on that
loop, blocking the calling thread until it finishes. Calling a ``SyncBackend`` from inside
its own loop would deadlock, so it raises instead.

Fast paths: a round trip to the IO thread (``run_coroutine_threadsafe``, a loop wake-up,
a wake-up of the caller) costs 40-200 us here, as much as copying a 4 MiB chunk out of
memory and a hundred times a dictionary lookup. A backend that can answer some calls
safely from any thread implements the optional protocols of
:mod:`lmcache_core.interface` (:class:`~lmcache_core.interface.ThreadSafeLoads`,
``ThreadSafeContains``, ``ThreadSafePuts``, ``ThreadSafeLookups``); ``SyncBackend`` tries
them first, in the calling thread, and sends only what they leave
undecided to the IO loop, in one hop per call (a batch included). The ``cpu`` backend
implements the loads, lookups and stores; the tiered hierarchy implements each of them
when the tiers involved can answer so (top-tier loads, lookups and leases over tiers that
all can, stores that concern the top tier alone).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .cuda_sync import settle_caller
from .interface import (
    PrefixLookups,
    StorageBackend,
    ThreadSafeContains,
    ThreadSafeLoads,
    ThreadSafeLookups,
    ThreadSafePuts,
    implements,
)
from .keys import CacheEngineKey
from .memory import copy_tensor

if TYPE_CHECKING:
    from .hierarchy.tiered import PrefixLookup

__all__ = ["IOLoopThread", "SyncBackend"]

T = TypeVar("T")


class IOLoopThread:
    """One asyncio event loop running in a daemon thread."""

    def __init__(self, name: str = "lmcache-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def thread_id(self) -> int | None:
        return self._thread.ident

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; return a thread-safe future."""
        if self.loop.is_closed() or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the IO loop thread has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (not from the loop thread)."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(
                "blocking call made from inside the lmcache IO loop; await the async API instead"
            )
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"lmcache IO call did not finish within {timeout} s") from None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and join the thread. Idempotent."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            if not self.in_loop_thread():
                self._thread.join(timeout)


class SyncBackend:
    """Blocking facade over an async backend, running every call on one IO thread.

    ``SyncBackend(backend)`` owns a new :class:`IOLoopThread` (stopped by :meth:`close`);
    pass ``loop_thread`` to share one. ``submit`` returns a future for callers that do not
    want to block (saving KV in the background, for example). With ``timeout`` (seconds),
    a call not over by then raises ``TimeoutError`` and is cancelled; loads through the
    IO loop then go into private buffers, copied into the caller's once the call is over,
    so a read a backend still runs in a thread never writes into a caller's buffer after
    the ``TimeoutError`` (a put past its timeout may still complete). Calls first try the
    backend's thread-safe capabilities (:mod:`lmcache_core.interface`), never from the IO
    thread itself.
    """

    def __init__(
        self,
        backend: StorageBackend,
        loop_thread: IOLoopThread | None = None,
        timeout: float | None = None,
    ) -> None:
        self.backend = backend
        self._owns_loop = loop_thread is None
        self.io = loop_thread or IOLoopThread()
        self.timeout = timeout
        self._loop_tid = self.io.thread_id
        b: object = backend
        self._fast_get = (
            b.try_batched_get_into_threadsafe if implements(b, ThreadSafeLoads) else None
        )
        self._fast_contains = (
            b.try_batched_contains_threadsafe if implements(b, ThreadSafeContains) else None
        )
        self._fast_put = b.try_batched_put_threadsafe if implements(b, ThreadSafePuts) else None
        self._fast_lookup = None
        self._fast_release = None
        if implements(b, ThreadSafeLookups):
            self._fast_lookup = b.try_lookup_prefix_threadsafe
            self._fast_release = b.try_release_threadsafe

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.io.run(coro, self.timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule any coroutine on the IO loop without waiting."""
        return self.io.submit(coro)

    def start(self) -> None:
        self._run(self.backend.start())

    def close(self) -> None:
        """Close the backend and, when owned, stop the IO thread. Idempotent."""
        if self.io.loop.is_closed() or not self.io._thread.is_alive():
            return
        try:
            self._run(self.backend.close())
        finally:
            if self._owns_loop:
                self.io.stop()

    def __enter__(self) -> SyncBackend:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def contains(self, key: CacheEngineKey) -> bool:
        fast = self._fast_contains
        if fast is not None and threading.get_ident() != self._loop_tid:
            res = fast((key,))
            if res is not None and res[0] is not None:
                return bool(res[0])
        return self._run(self.backend.contains(key))

    def get(self, key: CacheEngineKey) -> torch.Tensor | None:
        return self._run(self.backend.get(key))

    def _fast_path(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool | None] | None:
        fast = self._fast_get
        if fast is None or threading.get_ident() == self._loop_tid:
            return None
        res: list[bool | None] | None = fast(keys, outs)
        return res

    def get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        res = self._fast_path((key,), (out,))
        if res is not None and res[0] is not None:
            return res[0]
        bufs = self._load_buffers((out,))
        settle_caller(out, *bufs)  # (CUDA: the IO thread's stream is not the caller's)
        hit = self._run(self.backend.get_into(key, bufs[0]))
        self._hand_over([hit], (out,), bufs)
        return hit

    def _load_buffers(self, outs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """The buffers a load through the IO loop writes into: the caller's ``outs``, or
        with a ``timeout`` private ones, copied into ``outs`` only once the call is over
        (:meth:`_hand_over`): a call past its timeout is cancelled, but a read or copy a
        backend runs in a thread cannot be stopped and could otherwise write into the
        caller's buffers after the ``TimeoutError``, when the caller may already use them
        for something else."""
        return outs if self.timeout is None else [torch.empty_like(o) for o in outs]

    @staticmethod
    def _hand_over(
        hits: Sequence[bool], outs: Sequence[torch.Tensor], bufs: Sequence[torch.Tensor]
    ) -> None:
        if bufs is not outs:
            for hit, out, buf in zip(hits, outs, bufs, strict=True):
                if hit:
                    copy_tensor(out, buf)

    def _load_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool]:
        """``batched_get_into`` on the IO loop (see :meth:`_load_buffers`)."""
        bufs = self._load_buffers(outs)
        settle_caller(*outs, *bufs)
        hits = self._run(self.backend.batched_get_into(keys, bufs))
        self._hand_over(hits, outs, bufs)
        return hits

    def put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool = False) -> bool:
        fast = self._fast_put
        if fast is not None and threading.get_ident() != self._loop_tid:
            res = fast((key,), (value,), donate)
            if res is not None and res[0] is not None:
                return bool(res[0])
        settle_caller(value)
        return self._run(self.backend.put(key, value, donate))

    def remove(self, key: CacheEngineKey) -> bool:
        return self._run(self.backend.remove(key))

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        fast = self._fast_contains
        if fast is None or threading.get_ident() == self._loop_tid:
            return self._run(self.backend.batched_contains(keys))
        res = fast(keys)
        if res is None:
            return self._run(self.backend.batched_contains(keys))
        if None in res:
            todo = [i for i, r in enumerate(res) if r is None]
            rest = self._run(self.backend.batched_contains([keys[i] for i in todo]))
            for i, hit in zip(todo, rest, strict=True):
                res[i] = hit
        return res  # type: ignore[return-value]

    def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[torch.Tensor | None]:
        return self._run(self.backend.batched_get(keys))

    def batched_get_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool]:
        res = self._fast_path(keys, outs) if len(keys) == len(outs) else None
        if res is None:
            if len(keys) != len(outs):  # (the backend raises its own error for it)
                return self._run(self.backend.batched_get_into(keys, outs))
            return self._load_into(keys, outs)
        todo = [i for i, r in enumerate(res) if r is None]
        if todo:
            rest = self._load_into([keys[i] for i in todo], [outs[i] for i in todo])
            for i, hit in zip(todo, rest, strict=True):
                res[i] = hit
        return [bool(r) for r in res]

    def batched_put(
        self, keys: Sequence[CacheEngineKey], values: Sequence[torch.Tensor], donate: bool = False
    ) -> list[bool]:
        fast = self._fast_put
        if (
            fast is None
            or len(keys) != len(values)
            or threading.get_ident() == self._loop_tid
            or (res := fast(keys, values, donate)) is None
        ):
            settle_caller(*values)
            return self._run(self.backend.batched_put(keys, values, donate))
        if None in res:
            todo = [i for i, r in enumerate(res) if r is None]
            rest = self._run(
                self.backend.batched_put([keys[i] for i in todo], [values[i] for i in todo], donate)
            )
            for i, ok in zip(todo, rest, strict=True):
                res[i] = ok
        return res  # type: ignore[return-value]

    def lookup_prefix(
        self, keys: Sequence[CacheEngineKey], lease_s: float | None = None
    ) -> PrefixLookup:
        """The hierarchy's ``lookup_prefix`` (see :class:`~lmcache_core.TieredHierarchy`),
        answered in this thread when its tiers allow, else in one hop to the IO loop."""
        fast = self._fast_lookup
        if fast is not None and threading.get_ident() != self._loop_tid:
            res: PrefixLookup | None = fast(keys, lease_s)
            if res is not None:
                return res
        backend: object = self.backend
        if not implements(backend, PrefixLookups):
            raise TypeError(
                f"backend {self.backend.name!r} does not implement PrefixLookups "
                "(lookup_prefix, release)"
            )
        result: PrefixLookup = self._run(backend.lookup_prefix(keys, lease_s=lease_s))
        return result

    def release(self, keys: Sequence[CacheEngineKey]) -> int:
        """End one lease per key taken by :meth:`lookup_prefix`; how many ended."""
        fast = self._fast_release
        if fast is not None and threading.get_ident() != self._loop_tid:
            n: int | None = fast(keys)
            if n is not None:
                return n
        backend: object = self.backend
        if not implements(backend, PrefixLookups):
            raise TypeError(
                f"backend {self.backend.name!r} does not implement PrefixLookups "
                "(lookup_prefix, release)"
            )
        ended: int = self._run(backend.release(keys))
        return ended

    def stats(self) -> dict[str, Any]:
        return self.backend.stats()
