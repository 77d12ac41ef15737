"""The bounded background-store queue of one tier.

Stores to lower tiers never delay the caller: they are queued here and run by
``concurrency`` worker tasks. With ``store_batch`` a worker takes every store waiting
when it wakes (up to ``max_batch``) and runs them as one call: a tier's batched put
costs one index transaction and one flush wave for the batch instead of one per chunk
(nothing waits to fill a batch: a lone store runs alone). The queue sheds load instead of growing: a new store is
refused (and counted by the tier) when ``max_queue`` stores are pending or running, or
while the oldest pending store has waited longer than ``max_latency_s``. A key already
pending is not queued twice. Loads never pass through here, so they are never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from ..keys import CacheEngineKey
from .staging import StagedChunk
from .stats import TierStats

__all__ = ["WriteJob", "WriteQueue"]

log = logging.getLogger("lmcache_core.hierarchy")


@dataclass
class WriteJob:
    """One pending store: ``kind`` is ``through``, ``back`` or ``promote``;
    ``on_stored``: called with the outcome once the store ran (the tier calls them)."""

    key: CacheEngineKey
    chunk: StagedChunk
    kind: str
    enqueued_at: float = field(default_factory=time.monotonic)
    on_stored: list[Callable[[bool], None]] = field(default_factory=list)


class WriteQueue:
    """FIFO of :class:`WriteJob` with bounded depth and age, run by worker tasks."""

    def __init__(
        self,
        store: Callable[[WriteJob], Awaitable[None]],
        stats: TierStats,
        *,
        max_queue: int,
        max_latency_s: float | None,
        concurrency: int,
        name: str = "",
        store_batch: Callable[[list[WriteJob]], Awaitable[None]] | None = None,
        max_batch: int = 1,
    ) -> None:
        self._store = store
        self._store_batch = store_batch
        self.max_batch = max(1, max_batch) if store_batch is not None else 1
        self._stats = stats
        self.max_queue = max_queue
        self.max_latency_s = max_latency_s
        self.concurrency = concurrency
        self.name = name
        self._queued: OrderedDict[CacheEngineKey, WriteJob] = OrderedDict()
        self._running: dict[CacheEngineKey, list[asyncio.Future[None]]] = {}
        self._running_jobs: dict[CacheEngineKey, WriteJob] = {}
        self._nrunning = 0
        self._workers: list[asyncio.Task[None]] = []
        self._has_work = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self.completed = 0
        self.cancelled = 0

    @property
    def depth(self) -> int:
        """Stores pending or running."""
        return len(self._queued) + self._nrunning

    @property
    def pending(self) -> int:
        return len(self._queued)

    def refusal(self) -> str | None:
        """Why a new store would be dropped now (``None``: it would be accepted)."""
        if self._closed:
            return "closed"
        if self.depth >= self.max_queue:
            return "queue_full"
        if self.max_latency_s is not None and self._queued:
            oldest = next(iter(self._queued.values()))
            if time.monotonic() - oldest.enqueued_at > self.max_latency_s:
                return "queue_latency"
        return None

    def queued(self, key: CacheEngineKey) -> bool:
        """Whether a store of ``key`` is waiting (not yet running)."""
        return key in self._queued

    def has(self, key: CacheEngineKey) -> bool:
        """Whether a store of ``key`` is waiting or running."""
        return key in self._queued or key in self._running_jobs

    def peek(self, key: CacheEngineKey) -> torch.Tensor | None:
        """The value a waiting or running store of ``key`` carries (read-only)."""
        job = self._queued.get(key) or self._running_jobs.get(key)
        return None if job is None else job.chunk.value

    def enqueue(
        self,
        key: CacheEngineKey,
        chunk: StagedChunk,
        kind: str,
        on_stored: Callable[[bool], None] | None = None,
    ) -> bool:
        """Queue a store of ``chunk`` (retained here); ``False`` if ``key`` is already pending
        (``on_stored`` then waits for the pending store's outcome)."""
        pending = self._queued.get(key)
        if pending is not None:
            self._stats.coalesced_stores += 1
            if on_stored is not None:
                pending.on_stored.append(on_stored)
            return False
        self._queued[key] = WriteJob(
            key, chunk.retain(), kind, on_stored=[on_stored] if on_stored is not None else []
        )
        self._idle.clear()
        self._has_work.set()
        if len(self._workers) < self.concurrency:
            loop = asyncio.get_running_loop()
            self._workers.append(
                loop.create_task(self._worker(), name=f"lmcache-write-{self.name}")
            )
        return True

    def discard(self, key: CacheEngineKey) -> list[asyncio.Future[None]]:
        """Forget a pending store of ``key``; return futures of stores of it already running."""
        job = self._queued.pop(key, None)
        if job is not None:
            job.chunk.release()
            self._update_idle()
        return list(self._running.get(key, ()))

    def _update_idle(self) -> None:
        if not self._queued:
            self._has_work.clear()
            if self._nrunning == 0:
                self._idle.set()

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queued:
                await self._has_work.wait()
                continue
            await asyncio.sleep(0)  # one store per loop iteration and worker: never starve it
            if not self._queued:
                continue
            jobs = [
                self._queued.popitem(last=False)[1]
                for _ in range(min(self.max_batch, len(self._queued)))
            ]
            self._nrunning += len(jobs)
            done: asyncio.Future[None] = loop.create_future()
            now = time.monotonic()
            for job in jobs:
                self._running.setdefault(job.key, []).append(done)
                self._running_jobs[job.key] = job
                self._stats.queue_wait.add(now - job.enqueued_at)
            self._update_idle()
            reusable = True
            try:
                if len(jobs) == 1 or self._store_batch is None:
                    await self._store(jobs[0])
                else:
                    await self._store_batch(jobs)
                self.completed += len(jobs)
            except asyncio.CancelledError:
                reusable = False  # a copy may still be reading the buffers
                self.cancelled += len(jobs)
                raise
            except Exception:  # the tier wrapper counts errors; never kill the worker
                log.exception("background store to tier %r failed", self.name)
            finally:
                for job in jobs:
                    job.chunk.release(reusable)
                    futs = self._running.get(job.key)
                    if futs is not None:
                        futs.remove(done)
                        if not futs:
                            del self._running[job.key]
                    if self._running_jobs.get(job.key) is job:
                        del self._running_jobs[job.key]
                done.set_result(None)
                self._nrunning -= len(jobs)
                self._update_idle()

    async def flush(self) -> None:
        """Wait until every store queued so far (and any queued meanwhile) has finished."""
        await self._idle.wait()

    async def close(self, timeout: float) -> int:
        """Stop accepting stores, wait up to ``timeout`` s for pending ones, cancel the rest.

        Returns how many stores were cancelled or never run.
        """
        self._closed = True
        if self._workers:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout)
        dropped = len(self._queued)
        for job in self._queued.values():
            job.chunk.release()
        self._queued.clear()
        before = self.cancelled
        for w in self._workers:
            w.cancel()
        for w in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await w
        self._workers.clear()
        self._idle.set()
        return dropped + (self.cancelled - before)
