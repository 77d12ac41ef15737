"""A worker's background loads (vLLM's ``load_async``).

A request whose hit includes chunks outside the worker's memory tier is not scheduled
until its KV is in place (vLLM keeps it in ``WAITING_FOR_REMOTE_KVS``). A job first looks
its chunks up in the worker's hierarchy (pinning them where the tier can pin, and
learning which tier holds each; chunks after the first one missing fail at once), then
fetches each chunk on the storage's IO loop into a staging buffer and, as soon as that
chunk has arrived, copies it into the request's blocks in a helper thread — so copies
overlap the reads still running, and the engine's steps never wait for either. A chunk
found below the memory tier is promoted into it from the same staging buffer only after
the whole load is over (or when staging buffers run short), so promotions neither delay
``get_finished`` nor compete with the load's reads
(``TieredHierarchy.get_into_deferred``); once a promotion's store into the memory tier
has run, the chunk is handed to the worker (:meth:`AsyncLoads.take_promoted`), which
reports it to the scheduler as held in memory, as it reports its own saves: a later hit
on it loads before the forward pass instead of in the background. Each step's
:meth:`AsyncLoads.poll` (from ``get_finished``) collects what is done, starts fetches as
staging buffers come back, and reports the requests whose load is over.

A step that computes nothing (vLLM steps back to back while requests wait for their KV)
may first :meth:`AsyncLoads.wait_progress`: a few milliseconds at most, woken only by
what that step acts on (a lookup finished, so reads can be issued; a load whose every
chunk is in place or failed, so it can be reported; a staging buffer back while a load
waits for one), not by each chunk, so an idle engine does not spin a core that the reads
and copies need.

Blocks are written only while their load is live: vLLM keeps them allocated until the
request is reported. A load still running ``deadline_s`` after it started is abandoned
under the job's lock: no copy into vLLM's blocks starts afterwards (one already running
finishes first), its unfinished chunks fail (their blocks are recomputed), and its
buffers come back only once the reads really end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...hierarchy.tiered import PrefixLookup, Promotion
from ...keys import CacheEngineKey
from .group_copier import GroupedCopier
from .layout import BlockCopier
from .metadata import ChunkLoad
from .staging import ChunkBuffers
from .storage import Storage, pinned_keys

__all__ = ["AsyncLoads", "LoadOutcome"]

log = logging.getLogger("vllm.lmcache_core.loads")


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
    pinned: list[CacheEngineKey] = field(default_factory=list)  # released when over
    next: int = 0  # next chunk to fetch
    running: int = 0  # fetches in flight
    done: list[tuple[int, bool]] = field(default_factory=list)  # (chunk, loaded), any thread
    loaded: set[int] = field(default_factory=set)
    failed: list[int] = field(default_factory=list)  # indices into loads
    absent: list[int] = field(default_factory=list)  # failed because not found / unreadable
    cancelled: bool = False
    closed: bool = False  # set under lock: no copy into vLLM's blocks may start
    lock: threading.Lock = field(default_factory=threading.Lock)
    loaded_bytes: int = 0
    last_fetch: float = 0.0  # when the last fetch completed (any thread)
    #: seconds per phase, summed over chunks (see :attr:`AsyncLoads.spans`)
    spans: dict[str, float] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)  # chunks reported in done
    #: promotions waiting for the load to be over, each with its parked staging buffer
    promotions: list[tuple[int, Promotion, list[torch.Tensor]]] = field(default_factory=list)
    finished: bool = False  # set under the stats lock when poll reports it
    looked_up: float = 0.0  # when the lookup finished (IO loop)

    def over(self) -> bool:
        return self.lookup is None and self.next >= len(self.loads) and self.running == 0


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
        copier: BlockCopier | GroupedCopier,
        *,
        deadline_s: float,
        block_nbytes: int,
        defer_promotion: bool = True,
        after_promotion: Callable[[CacheEngineKey], Any] | None = None,
    ) -> None:
        self.storage = storage
        #: ``after_promotion(key)`` runs on the IO loop right after a promoted chunk is in
        #: the memory tier (before a later store can evict it); see :meth:`take_promoted`
        self.after_promotion = after_promotion
        self._promoted: list[tuple[int, int, Any]] = []
        #: promote a lower tier's hit after its copy into vLLM's blocks (``False``: before)
        self.defer_promotion = defer_promotion
        self.buffers = buffers
        self.copier = copier
        self.deadline_s = deadline_s
        self.block_nbytes = block_nbytes
        self._jobs: dict[str, _Job] = {}
        self.loaded_chunks = 0
        self.loaded_bytes = 0
        self.failed_chunks = 0
        self.deadline_misses = 0
        self.loaded_blocks_by_tier: dict[str, int] = {}
        self.scatter_seconds = 0.0
        self._stats_lock = threading.Lock()  # scatters run in helper threads
        #: per request: bytes, seconds from the first read to the poll reporting it
        #: finished, and to the last chunk in place
        self.throughput: list[tuple[int, float, float]] = []
        #: where the time of the first 64 finished loads went (see :meth:`_spans_ms`)
        self.spans: list[dict[str, float]] = []
        #: tier -> [bytes, seconds] of finished loads, by the tier of their deepest chunk
        self.rate_by_tier: dict[str, list[float]] = {}
        #: (tier, bytes, seconds) of each finished load since :meth:`take_observations`
        self._observations: list[tuple[str, int, float]] = []
        #: set when a lookup finishes, a load's last chunk is reported, or a buffer comes
        #: back while a load waits for one; cleared by :meth:`poll`
        self._progress = threading.Event()
        self._starved = False  # a load found no free staging buffer (poll's thread sets it)
        self._scatter_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="lmcache-scatter"
        )
        self.idle_wait_seconds = 0.0
        self.promoted = 0  # chunks promoted into the memory tier after their load

    def warm(self) -> None:
        """Do now what a process's first load would otherwise do on its way (slow: call
        it from a thread of its own; the connector does at ``register_kv_caches``, never
        on vLLM's thread): fault the staging buffers in and have the hierarchy fault in
        spare buffers for promoting chunks of this size."""
        self.buffers.fill()
        self.storage.hierarchy.pool.prepare(self.buffers.nbytes)

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

        def looked_up(_: object) -> None:
            job.looked_up = time.monotonic()
            self._progress.set()

        job.lookup.add_done_callback(looked_up)
        self._jobs[req_id] = job

    def wait_progress(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` until the next :meth:`poll` has something to act on
        (at once when it has, or when no load runs): a lookup finished, a load has every
        chunk in place or failed, or a staging buffer came back while a load waits for
        one. A chunk in place while others of its load still run does not end the wait."""
        if not self._jobs or self._progress.is_set():
            return
        t0 = time.perf_counter()
        self._progress.wait(timeout_s)
        self.idle_wait_seconds += time.perf_counter() - t0

    def cancel(self, req_ids: set[str]) -> None:
        """The requests finished (aborted): load nothing more into their blocks."""
        for r in req_ids:
            job = self._jobs.get(r)
            if job is not None:
                self._close(job)
                job.cancelled = True
                job.next = len(job.loads)

    @staticmethod
    def _close(job: _Job) -> None:
        with job.lock:  # waits for a copy into vLLM's blocks already running
            job.closed = True

    def _looked_up(self, job: _Job) -> None:
        assert job.lookup is not None
        fut, job.lookup = job.lookup, None
        try:
            res = fut.result()
            job.limit = res.num_hit
            job.pinned = pinned_keys(job.keys, res)
            job.tiers = [res.tier_of(i) for i in range(res.num_hit)]
        except Exception:
            job.limit = 0
        if not job.cancelled and job.limit < len(job.loads):
            job.failed.extend(range(job.limit, len(job.loads)))
            job.absent.append(job.limit)  # the ones after it were not even tried

    # ------------------------------------------------------------------ fetching
    def _issue(self, job: _Job) -> None:
        if job.lookup is not None or job.closed:
            return
        if job.next >= job.limit:
            job.next = len(job.loads)
            return
        while job.next < job.limit:
            t0 = time.perf_counter()
            buf = self.buffers.take()
            if buf is None:  # promotions parked until their load is over hold buffers
                self._starved = True  # (the next buffer given back wakes the idle wait)
                # A buffer given back between the failed take and the flag did not wake
                # anything (its giver saw the flag down): try once more now it is up.
                buf = self.buffers.take()
            if buf is None:
                for other in list(self._jobs.values()):
                    if other.promotions:
                        self._start_promotions(other)
                return
            self._span(job, "take", time.perf_counter() - t0)
            i = job.next
            job.next += 1
            job.running += 1
            if job.first_read is None:
                job.first_read = time.monotonic()
            held = [buf]  # (emptied by whoever gives it back first)
            fut = self.storage.submit(self._fetch(job, i, held, time.perf_counter()))
            fut.add_done_callback(self._on_fetched(job, i, held))

    def _span(self, job: _Job, name: str, seconds: float) -> None:
        with self._stats_lock:
            job.spans[name] = job.spans.get(name, 0.0) + seconds

    def _give(self, held: list[torch.Tensor]) -> None:
        """Give a fetch's staging buffer back (once)."""
        with self._stats_lock:
            buf = held.pop() if held else None
        if buf is not None:
            self.buffers.give(buf)
            if self._starved:
                self._progress.set()

    async def _fetch(self, job: _Job, i: int, held: list[torch.Tensor], submitted: float) -> None:
        """Read chunk ``i`` into the staging buffer ``held[0]``, copy it into the
        request's blocks and report it. A lower tier's hit is promoted into the memory
        tier from the same buffer, but only once the whole load is over (or staging
        buffers run short): see :meth:`_park`; the buffer goes back after that."""
        buf = held[0]
        t0 = time.perf_counter()
        self._span(job, "queue", t0 - submitted)
        try:
            h = self.storage.hierarchy
            if self.defer_promotion:
                hit, promote = await h.get_into_deferred(job.keys[i], buf)
            else:  # (the old order, kept for benchmarks/bench_async_load.py's A/B)
                hit, promote = await h.get_into(job.keys[i], buf), None
            t1 = time.perf_counter()
            self._span(job, "read", t1 - t0)
            ok = False
            if hit:
                # (its own threads: the IO loop's default pool may run at a lower priority)
                loop = asyncio.get_running_loop()
                ok = await loop.run_in_executor(self._scatter_pool, self._scatter, job, i, buf, t1)
            if ok and promote is not None:
                self._park(job, i, promote, held)
            else:
                self._give(held)
            self._report(job, i, ok)
        finally:
            self._give(held)  # (no-op when given above)
            self._report(job, i, False)  # (no-op when reported above)

    def _park(self, job: _Job, i: int, promote: Promotion, held: list[torch.Tensor]) -> None:
        """Keep a loaded chunk's promotion (and its staging buffer) until the load is over,
        so promotions never compete with the load's own reads and copies; at once when
        the load is already over."""
        with self._stats_lock:
            parked = [held.pop()] if held else []
            if not parked:
                return
            job.promotions.append((i, promote, parked))
            late = job.finished
        if late:
            self._start_promotions(job)

    def _start_promotions(self, job: _Job) -> None:
        """Run ``job``'s parked promotions on the IO loop; each gives its buffer back."""
        with self._stats_lock:
            todo, job.promotions = job.promotions, []
        for i, promote, parked in todo:
            try:
                self.storage.submit(self._promote(job, i, promote, parked))
            except RuntimeError:  # the IO loop has stopped: nothing to promote into
                self._give(parked)

    async def _promote(
        self, job: _Job, i: int, promote: Promotion, parked: list[torch.Tensor]
    ) -> None:
        t0 = time.perf_counter()
        try:
            await promote(on_top_stored=self._on_promoted(job.keys[i], job.loads[i]))
        except Exception as exc:  # a failed promotion costs a later hit, no more
            log.debug("promoting a loaded chunk failed: %s", exc)
        finally:
            self._give(parked)
            self._span(job, "promote", time.perf_counter() - t0)
            self.promoted += 1

    def _on_promoted(self, key: CacheEngineKey, ld: ChunkLoad) -> Callable[[bool], None]:
        """The listener of a promotion's store into the memory tier (runs on the IO loop)."""

        def stored(ok: bool) -> None:
            if not ok:
                return
            extra = self.after_promotion(key) if self.after_promotion is not None else None
            with self._stats_lock:
                self._promoted.append((ld.chunk_hash, ld.chunk_index, extra))

        return stored

    def take_promoted(self) -> list[tuple[int, int, Any]]:
        """``(hash, chunk index, after_promotion result)`` of the chunks whose promotion
        into the memory tier completed since the last call (the worker reports them as
        stored there, as it does its own saves)."""
        with self._stats_lock:
            out, self._promoted = self._promoted, []
        return out

    def _scatter(self, job: _Job, i: int, buf: torch.Tensor, read_done: float) -> bool:
        """Copy a fetched chunk into the request's blocks, unless the load is over."""
        ld = job.loads[i]
        n = len(ld.block_ids)
        with job.lock:
            if job.closed:
                return False
            t0 = time.perf_counter()
            event = self.copier.scatter_from_host(
                buf[:, ld.skip : ld.skip + n], ld.block_ids, ld.other_blocks
            )
            if event is not None:
                event.synchronize()
            spent = time.perf_counter() - t0
        with self._stats_lock:
            self.scatter_seconds += spent
            job.spans["hop"] = job.spans.get("hop", 0.0) + (t0 - read_done)
            job.spans["scatter"] = job.spans.get("scatter", 0.0) + spent
        return True

    def _report(self, job: _Job, i: int, ok: bool) -> None:
        """Chunk ``i`` is in place (``ok``) or failed: the next poll counts it (once: a
        later report of the same chunk is ignored)."""
        with self._stats_lock:
            if i in job.reported:
                return
            job.reported.add(i)
        job.last_fetch = time.monotonic()
        job.done.append((i, ok))  # list.append is atomic
        with self._stats_lock:
            # None is left to issue and every issued chunk (the first ``limit``: once
            # ``next`` reaches ``limit``, ``_issue`` moves it on to the end of the load)
            # is reported: the load is over at the next poll.
            complete = job.lookup is None and len(job.reported) >= job.limit <= job.next
        if complete or job.closed or self._starved:  # (starved: a parked promotion may
            self._progress.set()  # now start and free a buffer for the waiting load)

    def _on_fetched(
        self, job: _Job, i: int, held: list[torch.Tensor]
    ) -> Callable[[concurrent.futures.Future[None]], None]:
        def done(fut: concurrent.futures.Future[None]) -> None:
            if not fut.cancelled() and fut.exception() is not None:
                log.debug("a background load failed: %s", fut.exception())
            # (no-ops unless the fetch was cancelled before it ran: it failed)
            self._give(held)
            self._report(job, i, False)

        return done

    # ------------------------------------------------------------------ the step's side
    def poll(self) -> LoadOutcome:
        """Collect finished fetches, start more, abandon loads past their deadline, and
        report the loads that are over."""
        out = LoadOutcome()
        self._progress.clear()  # (what finishes from here on sets it again)
        self._starved = False  # (set again by _issue when buffers still run short)
        now = time.monotonic()
        for req_id, job in list(self._jobs.items()):
            if job.lookup is not None and job.lookup.done():
                self._looked_up(job)
            while job.done:
                i, ok = job.done.pop(0)
                job.running -= 1
                if job.cancelled:
                    continue
                if ok and not job.closed:
                    job.loaded.add(i)
                    n = len(job.loads[i].block_ids)
                    job.loaded_bytes += n * self.block_nbytes
                    self.loaded_chunks += 1
                    tier = job.tiers[i] if i < len(job.tiers) else "?"
                    self.loaded_blocks_by_tier[tier] = self.loaded_blocks_by_tier.get(tier, 0) + n
                elif not ok:
                    job.failed.append(i)
                    job.absent.append(i)
            if now - job.started > self.deadline_s and not job.over() and not job.closed:
                self._abandon(job)
            self._issue(job)
            if job.over() or (job.closed and job.lookup is None):
                del self._jobs[req_id]
                self._finish(job, out)
        return out

    def _abandon(self, job: _Job) -> None:
        """Past the deadline: no copy starts any more; what is not in place has failed."""
        self._close(job)
        if not job.cancelled:
            self.deadline_misses += 1
        if job.lookup is not None:
            lookup, job.lookup = job.lookup, None
            self._release_when_done(lookup, job.keys)
            job.limit = 0
        done = set(job.loaded) | set(job.failed)
        job.failed.extend(i for i in range(len(job.loads)) if i not in done)
        job.next = len(job.loads)

    def _release_when_done(
        self, fut: concurrent.futures.Future[PrefixLookup], keys: list[CacheEngineKey]
    ) -> None:
        storage = self.storage

        def done(f: concurrent.futures.Future[PrefixLookup]) -> None:
            if not f.cancelled() and f.exception() is None:
                storage.release_soon(pinned_keys(keys, f.result()))

        fut.add_done_callback(done)

    def _finish(self, job: _Job, out: LoadOutcome) -> None:
        with self._stats_lock:
            job.finished = True
        self._start_promotions(job)  # (the load is over; vLLM hears of it in this call)
        out.finished.add(job.req_id)
        self.storage.release_soon(job.pinned)
        if job.cancelled:
            return
        failed = sorted(set(job.failed))
        if failed:
            chunks = sorted({job.loads[i].chunk_index for i in failed})
            out.failed_chunks[job.req_id] = chunks
            for i in failed:
                out.failed_blocks.update(job.loads[i].block_ids)
            out.missing_hashes.extend(job.loads[i].chunk_hash for i in sorted(set(job.absent)))
            self.failed_chunks += len(chunks)
        self.loaded_bytes += job.loaded_bytes
        if job.first_read is not None and job.loaded_bytes:
            now = time.monotonic()
            seconds = now - job.first_read
            if len(self.spans) < 64:
                self.spans.append(self._spans_ms(job, now))
            self.throughput.append(
                (job.loaded_bytes, seconds, max(0.0, job.last_fetch - job.first_read))
            )
            tier = job.tiers[-1] if job.tiers else "?"
            acc = self.rate_by_tier.setdefault(tier, [0.0, 0.0])
            acc[0] += job.loaded_bytes
            acc[1] += seconds
            if len(self._observations) < 4096:
                self._observations.append((tier, job.loaded_bytes, seconds))

    @staticmethod
    def _spans_ms(job: _Job, now: float) -> dict[str, float]:
        """Where one load's time went, in ms: wall phases (``lookup``: start to the
        lookup's end; ``issue``: start to the first read; ``last``: the first read to the
        last chunk in place; ``report``: from then to this poll) and, summed over its
        chunks, ``take`` (staging buffer), ``queue`` (IO loop), ``read`` (tiers),
        ``hop`` (to a copy thread), ``scatter`` (into vLLM's blocks) and ``promote`` (into
        the memory tier: only promotions started early because staging buffers ran
        short; the others run after the load is over)."""
        assert job.first_read is not None
        out = {
            "bytes": float(job.loaded_bytes),
            "lookup": (job.looked_up - job.started) * 1e3 if job.looked_up else -1.0,
            "issue": (job.first_read - job.started) * 1e3,
            "last": (job.last_fetch - job.first_read) * 1e3,
            "report": (now - job.last_fetch) * 1e3,
        }
        for k, v in list(job.spans.items()):
            out[k] = v * 1e3
        return {k: round(v, 3) for k, v in out.items()}

    def take_observations(self) -> list[tuple[str, int, float]]:
        """``(deepest tier, bytes, seconds)`` of each load finished since the last call."""
        out, self._observations = self._observations, []
        return out

    def abandon_all(self) -> None:
        """Give up every load (shutdown): no copy into vLLM's blocks starts afterwards."""
        for job in self._jobs.values():
            self._close(job)
            job.cancelled = True
            with self._stats_lock:  # (parked promotions are dropped, their buffers kept)
                job.finished = True
                job.promotions = []
            if job.lookup is not None:
                self._release_when_done(job.lookup, job.keys)
            else:
                self.storage.release_soon(job.pinned)
        self._jobs.clear()
        self._scatter_pool.shutdown(wait=False)

    def pending_fetches(self) -> Any:
        """Fetches still running (tests)."""
        return sum(job.running for job in self._jobs.values())
