"""A worker's background loads (vLLM's ``load_async``).

A request whose hit includes chunks outside the worker's memory tier is not scheduled
until its KV is in place (vLLM keeps it in ``WAITING_FOR_REMOTE_KVS``). A job first looks
its chunks up in the worker's hierarchy (pinning them where the tier can pin, and
learning which tier holds each; chunks after the first one missing fail at once), then
reads them on the storage's IO loop into staging buffers, in batches as buffers allow; each step's :meth:`AsyncLoads.poll` (from ``get_finished``)
scatters what has arrived into vLLM's blocks — at most ``max_bytes_per_step`` per step —
and reports the requests whose load is over. A load still running ``deadline_s`` after
it started is abandoned: its remaining chunks fail (their blocks are recomputed) and its
buffers come back only once the reads really end, so a late read never writes into a
buffer in use.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...hierarchy import PrefixLookup
from ...keys import CacheEngineKey
from .layout import BlockCopier
from .metadata import ChunkLoad
from .staging import ChunkBuffers
from .storage import Storage

__all__ = ["AsyncLoads", "LoadOutcome"]


@dataclass
class _Job:
    req_id: str
    loads: list[ChunkLoad]
    keys: list[CacheEngineKey]
    started: float
    first_read: float | None = None
    lookup: concurrent.futures.Future[PrefixLookup] | None = None
    tiers: list[str] = field(default_factory=list)
    limit: int = 0  # chunks found by the lookup (the others fail)
    next: int = 0  # next chunk to read
    inflight: tuple[concurrent.futures.Future[list[bool]], list[int], list[torch.Tensor]] | None = (
        None
    )
    ready: list[tuple[int, torch.Tensor, bool]] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # indices into loads
    absent: list[int] = field(default_factory=list)  # failed because not found / unreadable
    cancelled: bool = False
    loaded_bytes: int = 0

    def over(self) -> bool:
        return (
            self.lookup is None
            and self.next >= len(self.loads)
            and self.inflight is None
            and not self.ready
        )


@dataclass
class LoadOutcome:
    """What :meth:`AsyncLoads.poll` finished: requests, their failed blocks and chunks."""

    finished: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)
    failed_chunks: dict[str, list[int]] = field(default_factory=dict)
    missing_hashes: list[int] = field(default_factory=list)


class AsyncLoads:
    """Background loads of whole requests (see the module docstring)."""

    def __init__(
        self,
        storage: Storage,
        buffers: ChunkBuffers,
        copier: BlockCopier,
        *,
        deadline_s: float,
        max_bytes_per_step: int,
        block_nbytes: int,
    ) -> None:
        self.storage = storage
        self.buffers = buffers
        self.copier = copier
        self.deadline_s = deadline_s
        self.max_bytes_per_step = max_bytes_per_step
        self.block_nbytes = block_nbytes
        self._jobs: dict[str, _Job] = {}
        self.loaded_chunks = 0
        self.loaded_bytes = 0
        self.failed_chunks = 0
        self.deadline_misses = 0
        self.loaded_blocks_by_tier: dict[str, int] = {}
        self.read_seconds = 0.0
        self.scatter_seconds = 0.0
        #: (bytes, seconds from first read to the poll reporting it finished) per request
        self.throughput: list[tuple[int, float]] = []
        #: tier -> [bytes, seconds] of finished loads, by the tier of their deepest chunk
        self.rate_by_tier: dict[str, list[float]] = {}

    @property
    def active(self) -> int:
        """Loads not over."""
        return len(self._jobs)

    def running(self) -> set[str]:
        """Requests whose load is not over."""
        return set(self._jobs)

    def hashes_in_use(self) -> set[int]:
        """Chunk hashes of the loads not over."""
        return {ld.chunk_hash for job in self._jobs.values() for ld in job.loads}

    def start(self, req_id: str, loads: list[ChunkLoad], keys: list[CacheEngineKey]) -> None:
        """Begin loading ``loads`` (one request's chunks, in order)."""
        job = _Job(req_id, loads, keys, time.monotonic())
        job.lookup = self.storage.submit(
            self.storage.hierarchy.lookup_prefix(keys, lease_s=self.deadline_s + 30.0)
        )
        self._jobs[req_id] = job

    def cancel(self, req_ids: set[str]) -> None:
        """The requests finished (aborted): load nothing more into their blocks."""
        for r in req_ids:
            job = self._jobs.get(r)
            if job is not None:
                job.cancelled = True
                job.next = len(job.loads)

    def _looked_up(self, job: _Job) -> None:
        assert job.lookup is not None
        fut, job.lookup = job.lookup, None
        try:
            res = fut.result()
            job.limit = res.num_hit
            job.tiers = [res.tier_of(i) for i in range(res.num_hit)]
        except Exception:
            job.limit = 0
        if not job.cancelled and job.limit < len(job.loads):
            job.failed.extend(range(job.limit, len(job.loads)))
            job.absent.append(job.limit)  # the ones after it were not even tried

    def _issue(self, job: _Job) -> None:
        if job.inflight is not None or job.lookup is not None or job.cancelled:
            return
        if job.next >= job.limit:
            job.next = len(job.loads)
            return
        bufs = self.buffers.take_many(job.limit - job.next)
        if not bufs:
            return
        idxs = list(range(job.next, job.next + len(bufs)))
        job.next += len(bufs)
        if job.first_read is None:
            job.first_read = time.monotonic()
        fut = self.storage.get_into_async([job.keys[i] for i in idxs], bufs)
        job.inflight = (fut, idxs, bufs)

    def _give_back_when_done(self, fut: concurrent.futures.Future[Any], bufs: list[Any]) -> None:
        def done(_: concurrent.futures.Future[Any]) -> None:
            for b in bufs:
                self.buffers.give(b)

        fut.add_done_callback(done)

    def poll(self) -> LoadOutcome:
        """Collect reads, scatter (within this step's byte budget), start further reads,
        abandon loads past their deadline; report the loads that ended."""
        out = LoadOutcome()
        budget = self.max_bytes_per_step
        now = time.monotonic()
        for req_id, job in list(self._jobs.items()):
            if job.lookup is not None and job.lookup.done():
                self._looked_up(job)
            if job.inflight is not None and job.inflight[0].done():
                fut, idxs, bufs = job.inflight
                job.inflight = None
                try:
                    hits = fut.result()
                except Exception:
                    hits = [False] * len(idxs)
                job.ready.extend(zip(idxs, bufs, hits, strict=True))
            while job.ready and (budget > 0 or job.cancelled):
                i, buf, hit = job.ready.pop(0)
                ld = job.loads[i]
                if hit and not job.cancelled:
                    t0 = time.perf_counter()
                    n = len(ld.block_ids)
                    event = self.copier.scatter_from_host(
                        buf[:, ld.skip : ld.skip + n], ld.block_ids
                    )
                    if event is not None:
                        event.synchronize()
                    self.scatter_seconds += time.perf_counter() - t0
                    nbytes = n * self.block_nbytes
                    budget -= nbytes
                    job.loaded_bytes += nbytes
                    self.loaded_chunks += 1
                    tier = job.tiers[i] if i < len(job.tiers) else "?"
                    self.loaded_blocks_by_tier[tier] = self.loaded_blocks_by_tier.get(tier, 0) + n
                elif not hit:
                    job.failed.append(i)
                    job.absent.append(i)
                self.buffers.give(buf)
            if now - job.started > self.deadline_s and not job.over():
                self._abandon(job)
            self._issue(job)
            if job.over():
                del self._jobs[req_id]
                self._finish(job, out)
        return out

    def _abandon(self, job: _Job) -> None:
        if not job.cancelled:
            self.deadline_misses += 1
        if job.lookup is not None:
            lookup, job.lookup = job.lookup, None
            self._release_when_done(lookup, job.keys)
            job.failed.extend(range(len(job.loads)))
            job.next = len(job.loads)
            return
        if job.inflight is not None:
            fut, idxs, bufs = job.inflight
            job.inflight = None
            job.failed.extend(idxs)
            self._give_back_when_done(fut, bufs)
        for i, buf, _ in job.ready:
            job.failed.append(i)
            self.buffers.give(buf)
        job.ready.clear()
        job.failed.extend(range(job.next, len(job.loads)))
        job.next = len(job.loads)

    def _release_when_done(
        self, fut: concurrent.futures.Future[PrefixLookup], keys: list[CacheEngineKey]
    ) -> None:
        storage = self.storage

        def done(f: concurrent.futures.Future[PrefixLookup]) -> None:
            if not f.cancelled() and f.exception() is None:
                storage.release_soon(keys[: f.result().num_hit])

        fut.add_done_callback(done)

    def _finish(self, job: _Job, out: LoadOutcome) -> None:
        out.finished.add(job.req_id)
        self.storage.release_soon(job.keys[: job.limit])
        if job.cancelled:
            return
        if job.failed:
            chunks = sorted({job.loads[i].chunk_index for i in job.failed})
            out.failed_chunks[job.req_id] = chunks
            for i in job.failed:
                out.failed_blocks.update(job.loads[i].block_ids)
            out.missing_hashes.extend(job.loads[i].chunk_hash for i in job.absent)
            self.failed_chunks += len(chunks)
        self.loaded_bytes += job.loaded_bytes
        if job.first_read is not None and job.loaded_bytes:
            seconds = time.monotonic() - job.first_read
            self.throughput.append((job.loaded_bytes, seconds))
            tier = job.tiers[-1] if job.tiers else "?"
            acc = self.rate_by_tier.setdefault(tier, [0.0, 0.0])
            acc[0] += job.loaded_bytes
            acc[1] += seconds

    def abandon_all(self) -> None:
        """Give up every load (shutdown)."""
        for job in self._jobs.values():
            job.cancelled = True
            if job.lookup is not None:
                self._release_when_done(job.lookup, job.keys)
            else:
                self.storage.release_soon(job.keys[: job.limit])
            if job.inflight is not None:
                fut, _, bufs = job.inflight
                job.inflight = None
                self._give_back_when_done(fut, bufs)
        self._jobs.clear()
