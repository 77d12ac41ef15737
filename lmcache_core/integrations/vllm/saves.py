"""A worker's saves: gathered inside the step, stored in the background.

:meth:`SaveQueue.submit` runs in ``wait_for_save``: it takes memory of the first tier
reserved for the chunk (recycled memory the tier keeps:
:meth:`~lmcache_core.hierarchy.tiered.TieredHierarchy.reserve_in_top_threadsafe`), else a
staging buffer (none free: the save is dropped and counted, never waited for), gathers
the chunk's blocks of every layer into it (one copy per chunk; on CUDA an asynchronous
copy on a side stream)
and hands the step's stores to the storage's IO loop in one call (a hand-over to another
thread costs ~0.3 ms here: one per step, not one per chunk). The step returns; the store into the
first tier and the write-through to lower tiers run meanwhile. A chunk counts as stored
(:meth:`take_stored`) only once the first tier holds it.

A chunk gathered into reserved memory is stored without further copies: the first tier
publishes that memory (``put_reserved``) and write-through tiers read it, borrowed. A
reservation whose gather failed, or whose store is refused or cancelled, is aborted:
nothing becomes visible. From a staging buffer the store copies the chunk into the tier
(and once more for the write-through), as before; that path serves the memory tier's
fill-up (no recycled memory yet: page faults stay off the engine thread), tiers that
cannot lend and ``use_reservations = False``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...cuda_sync import bind_thread, wait_ready
from ...hierarchy.tiered import Reservation
from ...keys import CacheEngineKey
from .group_copier import GroupedCopier
from .layout import BlockCopier
from .staging import ChunkBuffers
from .storage import Storage

__all__ = ["SaveItem", "SaveQueue"]


@dataclass
class SaveItem:
    """One chunk to save: its key and hash, who planned it, and the blocks holding it."""

    key: CacheEngineKey
    chunk_hash: int
    req_id: str
    chunk_index: int
    block_ids: list[int]
    other_blocks: list[list[int]] = field(default_factory=list)  # other KV-cache groups


@dataclass
class _Gathered:
    """One gathered chunk: into ``res.value`` when reserved, else into a staging buffer."""

    item: SaveItem
    buf: torch.Tensor
    event: Any
    res: Reservation | None


class SaveQueue:
    """Bounded background stores of gathered chunks (see the module docstring).

    ``after_store(key)`` (optional) runs on the IO loop right after a successful store,
    before any other store can evict the chunk (the connector pins it there under
    policy ``fail``); it returns what :meth:`take_stored` hands back with the hash.
    """

    def __init__(
        self,
        storage: Storage,
        buffers: ChunkBuffers,
        copier: BlockCopier | GroupedCopier,
        after_store: Callable[[CacheEngineKey], Any] | None = None,
    ) -> None:
        self.storage = storage
        self.buffers = buffers
        self.copier = copier
        self.after_store = after_store
        self._lock = threading.Lock()
        self._stored: list[tuple[int, int, Any]] = []
        self._refused: list[tuple[str, int]] = []
        # Items gathered and not yet finished (by id), and the batches storing them.
        self._pending: dict[int, tuple[SaveItem, torch.Tensor, Reservation | None]] = {}
        #: Gather into memory reserved in the first tier when it can lend (one copy).
        self.use_reservations = True
        self._open_reservations = 0
        #: Chunks gathered into reserved memory (the rest went through staging buffers).
        self.reserved = 0
        self._batches: set[concurrent.futures.Future[Any]] = set()
        self._events: dict[str, list[Any]] = {}
        self.gathered = 0
        self.gathered_bytes = 0
        self.stored = 0
        self.stored_bytes = 0
        self.dropped_full = 0
        self.refused = 0
        self.gather_seconds = 0.0
        self.store_seconds = 0.0
        #: (bytes, seconds) of each store since :meth:`take_observations`
        self._observations: list[tuple[int, float]] = []

    @property
    def pending(self) -> int:
        """Chunks gathered whose store has not finished."""
        with self._lock:
            return len(self._pending)

    def submit(self, items: list[SaveItem]) -> list[SaveItem]:
        """Gather ``items`` and queue their stores (one hand-over to the IO loop for the
        whole list); returns those dropped for lack of a buffer."""
        dropped: list[SaveItem] = []
        batch: list[_Gathered] = []
        nbytes = self.buffers.nbytes
        t0 = time.perf_counter()
        try:
            for item in items:
                res = None if self._full() else self._reserve()
                buf = res.value if res is not None else None
                if res is None and not self._full():
                    buf = self.buffers.take()
                if buf is None:
                    dropped.append(item)
                    continue
                try:
                    event = self.copier.gather_to_host(item.block_ids, buf, item.other_blocks)
                except BaseException:
                    if res is not None:
                        res.abort()  # nothing visible: the failed gather is never stored
                        with self._lock:
                            self._open_reservations -= 1
                    else:
                        self.buffers.give(buf)
                    raise
                self.gathered += 1
                self.gathered_bytes += nbytes
                if res is not None:
                    self.reserved += 1
                if event is not None:
                    self._events.setdefault(item.req_id, []).append(event)
                batch.append(_Gathered(item, buf, event, res))
        finally:
            self.gather_seconds += time.perf_counter() - t0
            if batch:
                self._queue(batch)
        self.dropped_full += len(dropped)
        return dropped

    def _reserve(self) -> Reservation | None:
        """Memory of the first tier for one chunk, within the same bound as the staging
        buffers (chunks gathered and not yet stored, either way, never exceed it)."""
        if not self.use_reservations:
            return None
        res = self.storage.reserve_in_memory(self.buffers.dtype, self.buffers.shape)
        if res is not None:
            with self._lock:
                self._open_reservations += 1
        return res

    def _full(self) -> bool:
        """Whether as many chunks are gathered and not yet stored as staging buffers exist."""
        with self._lock:
            return self._open_reservations + self.buffers.in_use >= self.buffers.max_buffers

    def _queue(self, batch: list[_Gathered]) -> None:
        with self._lock:
            for g in batch:
                self._pending[id(g.item)] = (g.item, g.buf, g.res)
        try:
            fut = self.storage.submit(self._store_all(batch))
        except BaseException:
            for g in batch:
                self._finish(g.item, False, None)
            raise
        with self._lock:
            self._batches.add(fut)
        fut.add_done_callback(lambda f: self._batch_done(f, batch))

    async def _store_all(self, batch: list[_Gathered]) -> None:
        await asyncio.gather(*(self._store(g.item, g.buf, g.event, g.res) for g in batch))

    async def _store(
        self, item: SaveItem, buf: torch.Tensor, event: Any, res: Reservation | None
    ) -> None:
        ok, extra = False, None
        try:
            if event is not None:
                await asyncio.to_thread(wait_ready, event, self.copier.device)
            t0 = time.perf_counter()
            if res is not None:
                ok = bool(await self.storage.hierarchy.put_reserved(item.key, res))
            else:
                ok = bool(await self.storage.hierarchy.put(item.key, buf))
            dt = time.perf_counter() - t0
            self.store_seconds += dt
            if ok:
                # (under the lock: take_observations swaps the list from another thread,
                # and an append to the old list after the swap would be lost)
                with self._lock:
                    if len(self._observations) < 4096:
                        self._observations.append((self.buffers.nbytes, dt))
            extra = self.after_store(item.key) if ok and self.after_store is not None else None
        finally:  # (cancelled or failed: refused)
            self._finish(item, ok, extra)

    def _finish(self, item: SaveItem, ok: bool, extra: Any) -> None:
        """Record one item's outcome and give its buffer back (once per item)."""
        with self._lock:
            entry = self._pending.pop(id(item), None)
            if entry is None:
                return
            if ok:
                self._stored.append((item.chunk_hash, item.chunk_index, extra))
                self.stored += 1
                self.stored_bytes += self.buffers.nbytes
            else:
                self._refused.append((item.req_id, item.chunk_index))
                self.refused += 1
        _, buf, res = entry
        if res is None:
            self.buffers.give(buf)
        else:
            with self._lock:
                self._open_reservations -= 1
            # (a no-op once stored or refused by put_reserved; a batch cancelled before it
            # ran ends its reservations here, nothing visible)
            res.abort(reusable=self._gather_done(item))

    def _gather_done(self, item: SaveItem) -> bool:
        """Whether no device copy can still write into ``item``'s memory."""
        events = self._events.get(item.req_id)
        return not events or self._complete(events)

    def _complete(self, events: list[Any]) -> bool:
        """Whether every one of ``events`` has completed (from any thread: bound to the
        cache's device first, once per thread)."""
        bind_thread(self.copier.device)
        return all(ev.query() for ev in events)

    def prune_events(self) -> None:
        """Forget the events of requests whose gathers are all complete (CUDA; called once
        per step: a request whose saves need no waiting at its end is never asked for by
        :meth:`gathered_for`, and its events would stay)."""
        if not self._events:
            return
        for req_id in [r for r, evs in self._events.items() if self._complete(evs)]:
            del self._events[req_id]

    def _batch_done(self, fut: concurrent.futures.Future[Any], batch: list[_Gathered]) -> None:
        # A batch cancelled before it ran never reached its items: they end here.
        for g in batch:
            self._finish(g.item, False, None)
        with self._lock:
            self._batches.discard(fut)

    def take_stored(self) -> list[tuple[int, int, Any]]:
        """``(hash, chunk index, after_store result)`` of chunks stored since the last call."""
        with self._lock:
            out, self._stored = self._stored, []
        return out

    def take_observations(self) -> list[tuple[int, float]]:
        """``(bytes, seconds)`` of each store completed since the last call."""
        with self._lock:
            out, self._observations = self._observations, []
        return out

    def take_refused(self) -> list[tuple[str, int]]:
        """``(request, chunk index)`` of stores the storage refused since the last call."""
        with self._lock:
            out, self._refused = self._refused, []
        return out

    def gathered_for(self, req_id: str) -> bool:
        """Whether every gather of ``req_id`` is complete (its blocks may be reused)."""
        events = self._events.get(req_id)
        if not events:
            return True
        if self._complete(events):
            del self._events[req_id]
            return True
        return False

    def wait_gathers(self) -> None:
        """Block until every gather issued so far is complete (no-op on CPU)."""
        for events in self._events.values():
            for ev in events:
                ev.synchronize()
        self._events.clear()

    def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for queued stores; cancel the rest and return how many
        chunks were not stored in time."""
        with self._lock:
            futs = list(self._batches)
        if not futs:
            return 0
        concurrent.futures.wait(futs, timeout=max(0.0, timeout))
        with self._lock:
            left = len(self._pending)
            futs = list(self._batches)
        for f in futs:
            f.cancel()
        return left
