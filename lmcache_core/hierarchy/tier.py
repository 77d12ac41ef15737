"""One tier of the hierarchy: a backend plus failure isolation, deadlines and statistics.

Every call into the backend goes through :meth:`Tier._call`: an ``Exception`` becomes a
miss (or a skipped lookup, or a dropped store) plus an error count and a retry backoff
(:class:`~lmcache_core.hierarchy.health.TierHealth`); ``asyncio.CancelledError``,
``KeyboardInterrupt`` and caller errors (:class:`~lmcache_core.errors.BufferMismatchError`)
propagate. Loads from a tier with ``load_deadline_ms`` go into a private staging buffer:
a load that misses its deadline is abandoned (left to finish in the background, its
buffer recycled afterwards) and can never write into the caller's buffer later. A load
within its deadline is handed over with :func:`~lmcache_core.memory.copy_tensor` (one
``memmove`` for host buffers, like every other host copy of the hierarchy).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..config import TierConfig
from ..errors import BufferMismatchError, ConfigError
from ..interface import BatchedPinning, Pinning, PrefixContains, implements
from ..keys import CacheEngineKey
from ..memory import copy_tensor
from .admission import BoundedKeySet, SightingCounter
from .codec import CodedBackendView, TierCodec
from .health import TierHealth
from .staging import StagedChunk, StagingPool
from .stats import TierStats
from .writer import WriteJob, WriteQueue

if TYPE_CHECKING:
    from ..placement.wiring import TierPlacement

__all__ = ["Tier", "notify_stored"]

log = logging.getLogger("lmcache_core.hierarchy")
T = TypeVar("T")

#: Loads abandoned after their deadline that may still run before the tier is skipped.
MAX_ABANDONED_LOADS = 32
#: Most background stores one batched put of a persistent tier takes (see ``WriteQueue``).
STORE_BATCH = 16


class _DeadlineMissed(Exception):
    """Internal: a load or lookup passed its deadline (already counted)."""


class _Release:
    """What to run once an abandoned load has really finished."""

    __slots__ = ("fn", "handed_over")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.handed_over = False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def notify_stored(
    listeners: Sequence[Callable[[bool], None]], key: CacheEngineKey, ok: bool
) -> None:
    """Tell each store listener (:meth:`Tier.enqueue`'s ``on_stored``) the outcome; a
    listener that raises is logged and never breaks the store's bookkeeping."""
    for fn in listeners:
        try:
            fn(ok)
        except Exception:
            log.exception("a store listener failed for %s", key)


class Tier:
    """Runtime state of one configured tier."""

    def __init__(self, cfg: TierConfig, backend: Any, pool: StagingPool) -> None:
        self.cfg = cfg
        self.backend = backend
        self.name = cfg.name
        self.index = cfg.index
        self.policy = cfg.write_policy
        self.pool = pool
        self.stats = TierStats()
        self.health = TierHealth(cfg.retry_backoff_ms / 1000.0, cfg.retry_backoff_max_ms / 1000.0)
        self.sightings = SightingCounter(cfg.admit_after)
        #: Keys known to be stored here (recent write-backs and hits): write-back skips them.
        self.known = BoundedKeySet()
        self.load_deadline = None if cfg.load_deadline_ms is None else cfg.load_deadline_ms / 1000.0
        self.lookup_deadline = (
            None if cfg.lookup_deadline_ms is None else cfg.lookup_deadline_ms / 1000.0
        )
        self.writer = WriteQueue(
            self._store_job,
            self.stats,
            max_queue=cfg.max_queue,
            max_latency_s=None
            if cfg.max_queue_latency_ms is None
            else cfg.max_queue_latency_ms / 1e3,
            concurrency=cfg.write_concurrency,
            name=cfg.name,
            # Persistent tiers without a codec take the stores waiting together as one
            # batched put (one index transaction and flush wave per batch, not per chunk);
            # memory tiers keep one put per store (each may take its buffer, donated).
            store_batch=self._store_jobs
            if cfg.codec_impl is None and backend.capabilities.persistent
            else None,
            max_batch=STORE_BATCH,
        )
        #: The tier's codec (``codec:`` in its configuration), or ``None``.
        self.codec = TierCodec(cfg.codec_impl) if cfg.codec_impl is not None else None
        #: Where loads and stores go: the backend, or the backend through the codec.
        self.data: Any = backend if self.codec is None else CodedBackendView(backend, self.codec)
        #: This tier's placement policy (``None``: the backend's own order, admission by
        #: ``admit_after`` alone; set by the hierarchy when a policy is configured).
        self.placement: TierPlacement | None = None
        self.can_pin = implements(backend, Pinning)
        self.started = False
        self._abandoned = 0
        self._memory_tier = not backend.capabilities.persistent

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Start the backend. A ``ConfigError`` propagates; any other error marks the tier
        failing (it is retried with backoff on later calls)."""
        await self._try_start(raise_config=True)

    async def _try_start(self, raise_config: bool = False) -> bool:
        try:
            await self.backend.start()
        except asyncio.CancelledError:
            raise
        except ConfigError:
            if raise_config:
                raise
            return False
        except Exception as exc:
            self._failed("start", exc)
            return False
        self.started = True
        return True

    async def close(self, drain_timeout: float) -> None:
        """Drain (up to ``drain_timeout``) or cancel background stores, then close the backend."""
        lost = await self.writer.close(drain_timeout)
        if lost:
            self.stats.drop("closed", lost)
            log.warning("tier %r: %d background stores not done at close", self.name, lost)
        try:
            await self.backend.close()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed("close", exc)

    # ------------------------------------------------------------------ isolation
    def usable(self) -> bool:
        """Whether calls may go to the tier now (healthy, or its retry time has come)."""
        return self.health.usable()

    def _failed(self, what: str, exc: BaseException) -> None:
        self.stats.errors += 1
        first = self.health.consecutive_errors == 0
        self.health.failed(exc)
        (log.warning if first else log.debug)(
            "tier %r: %s failed (%s: %s); skipped for %.2f s",
            self.name,
            what,
            type(exc).__name__,
            exc,
            self.health.retry_at - time.monotonic(),
        )

    def _succeeded(self) -> None:
        if self.health.consecutive_errors:
            log.info("tier %r recovered after %d errors", self.name, self.health.consecutive_errors)
        self.health.succeeded()

    async def _ready(self) -> bool:
        if not self.health.usable():
            return False
        if not self.started:
            return await self._try_start()
        return True

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]], default: T) -> T:
        if not await self._ready():
            self.stats.skipped += 1
            return default
        try:
            result = await fn()
        except _DeadlineMissed:
            return default
        except BufferMismatchError:
            raise  # the caller's buffer is wrong: their error, not the tier's
        except Exception as exc:  # CancelledError / KeyboardInterrupt are not Exceptions
            self._failed(what, exc)
            return default
        self._succeeded()
        return result

    async def _with_lookup_deadline(self, coro: Awaitable[T]) -> T:
        if self.lookup_deadline is None:
            return await coro
        try:
            async with asyncio.timeout(self.lookup_deadline) as cm:
                return await coro
        except TimeoutError:
            if cm.expired():
                self.stats.timeouts += 1
                raise _DeadlineMissed from None
            raise

    async def _with_load_deadline(
        self, make: Callable[[], Awaitable[T]], release: _Release | None = None
    ) -> T:
        """Run a load with the tier's deadline. Past it, the load is abandoned, not cancelled
        (a copy running in a thread cannot be stopped): it finishes in the background, then
        ``release`` runs (and ``release.handed_over`` is set at once); the caller sees
        :class:`_DeadlineMissed`. Otherwise the caller keeps ``release`` to run itself."""
        assert self.load_deadline is not None
        if self._abandoned >= MAX_ABANDONED_LOADS:
            self.stats.skipped += 1
            raise _DeadlineMissed
        task = asyncio.ensure_future(make())
        try:
            done, _ = await asyncio.wait({task}, timeout=self.load_deadline)
        except BaseException:
            self._abandon(task, release)
            raise
        if not done:
            self.stats.timeouts += 1
            self._abandon(task, release)
            raise _DeadlineMissed
        return task.result()

    def _abandon(self, task: asyncio.Future[Any], release: _Release | None) -> None:
        self._abandoned += 1
        if release is not None:
            release.handed_over = True

        def finished(t: asyncio.Future[Any]) -> None:
            self._abandoned -= 1
            if not t.cancelled() and t.exception() is not None:
                self.stats.errors += 1
            if release is not None:
                release.fn()

        task.add_done_callback(finished)

    # ------------------------------------------------------------------ lookups
    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool] | None:
        """Which keys the tier holds; ``None`` when it was skipped, failed or too slow."""
        t0 = time.perf_counter()
        res = await self._call(
            "lookup", lambda: self._with_lookup_deadline(self.backend.batched_contains(keys)), None
        )
        self.stats.lookup_latency.add(time.perf_counter() - t0)
        self.stats.lookups += 1
        self.stats.lookup_keys += len(keys)
        if res is None:
            return None
        found = [bool(x) for x in res]
        self.stats.lookup_found += sum(found)
        return found

    async def contains_prefix(self, keys: Sequence[CacheEngineKey]) -> list[bool] | None:
        """Like :meth:`batched_contains`, for a prefix lookup: a backend with a native
        ``contains_prefix(keys) -> int`` (how many leading keys it holds; the byte-store
        base has one: ``ceil(log2(n)) + 1`` requests) answers for the leading keys only,
        the rest reported missing."""
        backend = self.backend
        if not implements(backend, PrefixContains):
            return await self.batched_contains(keys)
        native = backend.contains_prefix
        t0 = time.perf_counter()
        res = await self._call("lookup", lambda: self._with_lookup_deadline(native(keys)), None)
        self.stats.lookup_latency.add(time.perf_counter() - t0)
        self.stats.lookups += 1
        self.stats.lookup_keys += len(keys)
        if res is None:
            return None
        n = max(0, min(len(keys), int(res)))
        self.stats.lookup_found += n
        return [True] * n + [False] * (len(keys) - n)

    # ------------------------------------------------------------------ loads
    def _count_loads(self, hits: Sequence[bool], nbytes: Sequence[int], t0: float) -> None:
        n_hit = sum(hits)
        self.stats.hits += n_hit
        self.stats.misses += len(hits) - n_hit
        self.stats.bytes_out += sum(b for h, b in zip(hits, nbytes, strict=True) if h)
        self.stats.load_latency.add(time.perf_counter() - t0)

    async def get(self, key: CacheEngineKey) -> torch.Tensor | None:
        t0 = time.perf_counter()
        if self.load_deadline is None:
            value = await self._call("load", lambda: self.data.get(key), None)
        else:
            value = await self._call(
                "load", lambda: self._with_load_deadline(lambda: self.data.get(key)), None
            )
        self._count_loads([value is not None], [0 if value is None else _nbytes(value)], t0)
        return value if isinstance(value, torch.Tensor) else None

    async def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[torch.Tensor | None]:
        t0 = time.perf_counter()
        miss: list[torch.Tensor | None] = [None] * len(keys)
        if self.load_deadline is None:
            values = await self._call("load", lambda: self.data.batched_get(keys), miss)
        else:
            values = await self._call(
                "load",
                lambda: self._with_load_deadline(lambda: self.data.batched_get(keys)),
                miss,
            )
        self._count_loads(
            [v is not None for v in values], [0 if v is None else _nbytes(v) for v in values], t0
        )
        return list(values)

    async def get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        hits = await self.batched_get_into([key], [out], single=True)
        return hits[0]

    async def batched_get_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor], single: bool = False
    ) -> list[bool]:
        t0 = time.perf_counter()
        miss = [False] * len(keys)
        if self.load_deadline is None:
            if single:
                hits = await self._call("load", lambda: self._one_into(keys[0], outs[0]), miss)
            else:
                hits = await self._call(
                    "load", lambda: self.data.batched_get_into(keys, outs), miss
                )
        else:
            hits = await self._call("load", lambda: self._staged_into(keys, outs, single), miss)
        self._count_loads(hits, [_nbytes(o) for o in outs], t0)
        return list(hits)

    async def _one_into(self, key: CacheEngineKey, out: torch.Tensor) -> list[bool]:
        return [bool(await self.data.get_into(key, out))]

    async def _staged_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor], single: bool
    ) -> list[bool]:
        staging = [self.pool.take_like(o) for o in outs]

        def give_back() -> None:
            for buf in staging:
                self.pool.give(buf)

        async def load() -> list[bool]:
            if single:
                return [bool(await self.data.get_into(keys[0], staging[0]))]
            return list(await self.data.batched_get_into(keys, staging))

        release = _Release(give_back)
        try:
            hits = await self._with_load_deadline(load, release)
            for h, buf, out in zip(hits, staging, outs, strict=True):
                if h:
                    copy_tensor(out, buf)
            return hits
        finally:
            if not release.handed_over:
                give_back()

    # ------------------------------------------------------------------ stores
    def admits(self, key: CacheEngineKey, nbytes: int = 0) -> bool:
        """Record a sighting of ``key`` and say whether this tier's admission lets it in:
        ``admit_after``, then the placement policy (if any) for a chunk of ``nbytes``."""
        if not self.sightings.admit(key):
            self.stats.not_admitted += 1
            return False
        return self.placement_admits(key, nbytes)

    def placement_admits(self, key: CacheEngineKey, nbytes: int = 0) -> bool:
        """The placement policy's admission alone (a promotion's: it counts no
        ``admit_after`` sighting); a refusal counts in ``not_admitted``."""
        if self.placement is None or self.placement.admits(key, nbytes):
            return True
        self.stats.not_admitted += 1
        return False

    def accepting(self) -> bool:
        """Whether a background store would be queued now; counts the drop if not."""
        if not self.health.usable():
            self.stats.drop("tier_failing")
            return False
        reason = self.writer.refusal()
        if reason is not None:
            self.stats.drop(reason)
            return False
        return True

    def enqueue(
        self,
        key: CacheEngineKey,
        chunk: StagedChunk,
        kind: str,
        on_stored: Callable[[bool], None] | None = None,
    ) -> None:
        """Queue a background store (call :meth:`accepting` first). ``on_stored(ok)`` runs
        on the loop right after the store ran, before any later store (which could evict
        the chunk again); not at all for a store dropped unrun (queue closed)."""
        self.writer.enqueue(key, chunk, kind, on_stored)

    @staticmethod
    def _notify(job: WriteJob, ok: bool) -> None:
        notify_stored(job.on_stored, job.key, ok)

    async def _store_job(self, job: WriteJob) -> None:
        if not await self._ready():
            self.stats.drop("tier_failing")
            self._notify(job, False)
            return
        t0 = time.perf_counter()
        value = job.chunk.value
        # The last holder of a staged chunk donates it to a memory tier, which keeps the
        # buffer instead of copying it on the event loop. A persistent tier writes the
        # bytes out and keeps nothing: the buffer goes back to the pool for reuse.
        donate = self._memory_tier and self.codec is None and job.chunk.exclusive()
        if donate:
            job.chunk.donated()
        try:
            ok = await self.data.put(job.key, value, donate)
        except Exception as exc:
            self.stats.store_failures += 1
            self._failed("store", exc)
            self._notify(job, False)
            return
        self._succeeded()
        self.stats.store_latency.add(time.perf_counter() - t0)
        self._stored(job, ok)

    async def _store_jobs(self, jobs: list[WriteJob]) -> None:
        """Background stores waiting together, as one batched put (never donated: only
        persistent tiers without a codec batch them, see ``__init__``)."""
        if not await self._ready():
            self.stats.drop("tier_failing", len(jobs))
            for job in jobs:
                self._notify(job, False)
            return
        t0 = time.perf_counter()
        try:
            results = await self.data.batched_put(
                [j.key for j in jobs], [j.chunk.value for j in jobs], False
            )
        except Exception as exc:
            self.stats.store_failures += len(jobs)
            self._failed("store", exc)
            for job in jobs:
                self._notify(job, False)
            return
        self._succeeded()
        dt = time.perf_counter() - t0
        for job, ok in zip(jobs, results, strict=True):
            self.stats.store_latency.add(dt)
            self._stored(job, ok)

    def _stored(self, job: WriteJob, ok: bool) -> None:
        """Count one finished background store."""
        value = job.chunk.value
        if ok:
            self.stats.stores += 1
            self.stats.bytes_in += _nbytes(value)
            self.known.add(job.key)
            if self.placement is not None:
                self.placement.stored(job.key, _nbytes(value))
            if job.kind == "back":
                self.stats.write_backs += 1
            elif job.kind == "promote":
                self.stats.promotions += 1
        else:
            self.stats.store_failures += 1
        self._notify(job, ok)

    async def put_now(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        """A store awaited by the caller (the top tier's)."""
        t0 = time.perf_counter()
        ok = await self._call("store", lambda: self.data.put(key, value, donate), False)
        self.stats.store_latency.add(time.perf_counter() - t0)
        if ok:
            self.stats.stores += 1
            self.stats.bytes_in += _nbytes(value)
            if self.placement is not None:
                self.placement.stored(key, _nbytes(value))
        else:
            self.stats.store_failures += 1
        return bool(ok)

    def commit_reserved(
        self, key: CacheEngineKey, handle: object, nbytes: int, borrow: bool
    ) -> tuple[bool, object | None]:
        """Publish a reservation of this tier's backend
        (:class:`~lmcache_core.interface.ReservedPuts`) under ``key``, counted as a store
        the caller awaited (:meth:`put_now`); a backend error counts as a failed store
        (the reservation is then aborted). ``(stored, borrow handle)``."""
        t0 = time.perf_counter()
        try:
            ok, handle_out = self.backend.commit_reserved(handle, key, borrow)
        except Exception as exc:
            self._failed("store", exc)
            ok, handle_out = False, None
            with contextlib.suppress(Exception):  # already counted: the tier is failing
                self.backend.abort_reserved(handle, False)
        else:
            self._succeeded()
        self.stats.store_latency.add(time.perf_counter() - t0)
        if ok:
            self.stats.stores += 1
            self.stats.bytes_in += nbytes
            if self.placement is not None:
                self.placement.stored(key, nbytes)
        else:
            self.stats.store_failures += 1
        return bool(ok), handle_out

    async def remove(self, key: CacheEngineKey) -> bool:
        """Remove ``key``, after any background store of it has finished."""
        self.known.discard(key)
        self.sightings.forget(key)
        for fut in self.writer.discard(key):
            await asyncio.shield(fut)
        if self.placement is not None:
            self.placement.removed(key)
        return bool(await self._call("remove", lambda: self.backend.remove(key), False))

    # ------------------------------------------------------------------ pins
    def pin_many(self, keys: Sequence[CacheEngineKey]) -> list[object | None]:
        """Pin each key in the tier; a handle per key for :meth:`unpin_many`, or ``None``.

        A tier pins when its backend implements :class:`~lmcache_core.interface.Pinning`
        (:class:`~lmcache_core.interface.BatchedPinning` is used when implemented)."""
        if not self.can_pin:
            return [None] * len(keys)
        try:
            if implements(self.backend, BatchedPinning):
                return list(self.backend.pin_many(keys))
            return [self.backend.pin(k) for k in keys]
        except Exception as exc:
            self._failed("pin", exc)
            return [None] * len(keys)

    def unpin_many(self, handles: Sequence[object]) -> None:
        if not handles:
            return
        try:
            if implements(self.backend, BatchedPinning):
                self.backend.unpin_many(handles)
            else:
                for h in handles:
                    self.backend.unpin(h)
        except Exception as exc:
            self._failed("unpin", exc)

    # ------------------------------------------------------------------ introspection
    def snapshot(self) -> dict[str, Any]:
        """JSON-friendly state of the tier."""
        try:
            backend_stats = self.backend.stats()
        except Exception as exc:
            backend_stats = {"error": f"{type(exc).__name__}: {exc}"}
        return {
            "name": self.name,
            "index": self.index,
            "backend": self.cfg.backend,
            "write_policy": self.policy,
            "admit_after": self.cfg.admit_after,
            "promote": self.cfg.promote,
            "health": self.health.as_dict(),
            "queue_depth": self.writer.depth,
            "abandoned_loads": self._abandoned,
            **({"codec": self.codec.stats()} if self.codec is not None else {}),
            **self.stats.as_dict(),
            "backend_stats": backend_stats,
        }
