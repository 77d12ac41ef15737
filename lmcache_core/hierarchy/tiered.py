"""The tiered hierarchy: an ordered list of storage backends used as one.

:class:`TieredHierarchy` is itself a :class:`~lmcache_core.StorageBackend` (the contract
suite runs against it unchanged). Tiers come from the configuration
(:func:`~lmcache_core.load_config`), fastest first.

* **Lookups.** :meth:`TieredHierarchy.lookup_prefix` says how many leading chunks of a
  prompt are available in any tier and which tier holds each, asking each tier once
  (``batched_contains``) about the chunks the tiers above did not have. A tier that does
  not answer within its ``lookup_deadline_ms`` is skipped for that lookup. With
  ``lease_s`` the chunks found are pinned in their tier (where the tier can pin: the
  ``cpu`` tier can) until :meth:`~TieredHierarchy.release` or the lease ends.
* **Loads** (``get``, ``get_into`` and their batched forms) are served by the fastest tier
  holding the chunk; a tier past its ``load_deadline_ms`` counts as a miss. A chunk found
  below the top tier is promoted (``promote: true``, the default): copied, in the
  background, into the top tier and the write-through tiers above it.
* **Stores** go to the top tier (awaited) and flow down by each lower tier's ``write``
  policy: ``through`` -- a background store on every put; ``back`` -- stored when the
  tier above evicts the chunk (that tier must report evictions, as ``cpu`` does);
  ``none`` -- never written. ``admit_after: N`` admits a chunk into a tier only from its
  Nth sighting. Background stores never delay the caller beyond one copy of the value;
  each tier's queue is bounded (``max_queue``, ``max_queue_latency_ms``) and sheds new
  stores when full (counted as ``dropped_stores``). Loads are never shed.
* **Reserved stores.** :meth:`TieredHierarchy.reserve_in_top_threadsafe` lends memory of
  a top tier with :class:`~lmcache_core.interface.ReservedPuts` (``cpu``) for a chunk the
  caller then writes itself; :meth:`TieredHierarchy.put_reserved` publishes that memory
  in the top tier and hands the write-through tiers the same memory, borrowed until
  their stores ended: no copy at all (the vLLM connector's saves gather into it).
* **Failures.** A tier raising an ``Exception`` gives misses, skipped lookups or dropped
  stores, counted as ``errors``, and is skipped with exponential backoff until a retry
  succeeds; the caller never sees the exception (``asyncio.CancelledError`` and
  ``KeyboardInterrupt`` propagate; so does ``BufferMismatchError``, which is the caller's).
* **Close.** ``await close()`` drains: it waits up to ``drain_timeout_s`` for pending
  background stores, tier by tier from the top (a tier's stores can evict into the next),
  cancels what is left (counted as dropped with reason ``closed``), then closes the tiers.
  :meth:`~TieredHierarchy.flush` waits for pending stores without closing.
* **Placement.** With a ``placement`` section naming a policy other than ``lru``, each
  tier gets its own policy (:mod:`lmcache_core.placement.wiring`): it sees every lookup,
  store, removal and eviction, decides admission with ``admit_after`` (stores,
  write-through, write-back, promotion), and chooses the victims of tiers whose backend
  lets it (``cpu``); shared tiers keep their own eviction. Without the section (or with
  ``lru``) no policy object exists and every path is as described above.
* **Eviction events.** :meth:`~TieredHierarchy.add_eviction_listener` subscribes any
  number of listeners to capacity evictions in every tier that reports them (``cpu``
  does); write-back is one more consumer of the same event.
* **Statistics.** :meth:`~TieredHierarchy.stats` includes, per tier, hits, misses, bytes
  in/out, load/lookup/store latency percentiles, queue depth, dropped stores and errors;
  with ``stats_dir`` set they are also written to ``<stats_dir>/<pid>.json`` every
  ``stats_interval_s`` (read by ``lmcache-core inspect``).
* **Sync callers.** :meth:`~TieredHierarchy.try_get_into_threadsafe` serves a top-tier
  hit from the calling thread when the top tier supports it (``cpu`` does);
  :class:`~lmcache_core.SyncBackend` uses it, which saves the event-loop round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..backend import BaseBackend, Capabilities, _check_key, _check_out, _check_put_key
from ..config import CacheConfig, load_config
from ..config.namespaces import namespace_label, namespace_warnings, resolve_namespace
from ..cuda_sync import host_copy, ready_event
from ..errors import ConfigError
from ..interface import (
    EntryCharges,
    EvictionEvents,
    ReservedPuts,
    ThreadSafeBorrows,
    ThreadSafeContains,
    ThreadSafeLoads,
    ThreadSafePuts,
    VictimSelection,
    implements,
    pins_do_io,
)
from ..keys import CacheEngineKey, Namespace
from ..memory import copy_tensor
from .leases import LeaseTable
from .staging import CopyBudget, StagedChunk, StagingPool
from .stats import LatencyReservoir, StatsFileWriter
from .tier import Tier, notify_stored

if TYPE_CHECKING:
    from ..placement.wiring import ChainBook

__all__ = ["EvictionListener", "PrefixLookup", "Promotion", "Reservation", "TieredHierarchy"]

#: ``listener(tier_name, key)``: called after ``key`` was evicted from that tier for capacity.
EvictionListener = Callable[[str, CacheEngineKey], None]

log = logging.getLogger("lmcache_core.hierarchy")


class Promotion(Protocol):
    """What :meth:`TieredHierarchy.get_into_deferred` hands back for a lower tier's hit."""

    def __call__(self, on_top_stored: Callable[[bool], None] | None = None) -> Awaitable[None]: ...


@dataclass(frozen=True)
class PrefixLookup:
    """Result of :meth:`TieredHierarchy.lookup_prefix`.

    ``num_hit`` leading keys are available; ``tiers[i]`` is the index of the fastest tier
    holding key ``i`` (for ``i < num_hit``). ``skipped`` names tiers that were failing or
    missed their lookup deadline; ``leased`` counts the hits pinned by this lookup and
    ``pinned[i]`` (with ``lease_s``) says whether hit ``i`` is one of them. Release only
    the pinned ones: :meth:`TieredHierarchy.release` ends one lease per key, whoever took
    it, so releasing a key this lookup did not pin ends another caller's lease.
    """

    num_hit: int
    tiers: tuple[int, ...]
    tier_names: tuple[str, ...] = field(repr=False)
    skipped: tuple[str, ...] = ()
    leased: int = 0
    pinned: tuple[bool, ...] = ()

    def tier_of(self, i: int) -> str:
        """Name of the tier holding key ``i`` (``i < num_hit``)."""
        return self.tier_names[self.tiers[i]]

    def counts(self) -> dict[str, int]:
        """Hit chunks per tier name."""
        out = dict.fromkeys(self.tier_names, 0)
        for t in self.tiers:
            out[self.tier_names[t]] += 1
        return out


class Reservation:
    """Memory of the top tier lent for one chunk (:meth:`TieredHierarchy.reserve_in_top_threadsafe`).

    Fill ``value`` (a writable tensor of the requested dtype and shape), then either
    :meth:`TieredHierarchy.put_reserved` it or :meth:`abort` it. It ends exactly once:
    later aborts are no-ops. Nothing is visible under any key before the commit."""

    __slots__ = ("_backend", "_lock", "_open", "handle", "value")

    def __init__(self, value: torch.Tensor, handle: object, backend: Any) -> None:
        self.value = value
        self.handle = handle
        self._backend = backend
        self._open = True
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        """Neither committed nor aborted yet."""
        return self._open

    def ended(self) -> None:
        """The backend took over the reservation (committed it, or aborted it itself)."""
        with self._lock:
            self._open = False

    def abort(self, reusable: bool = True) -> None:
        """Give the memory back with nothing stored (a no-op once ended). ``reusable=False``
        when something may still read or write it: the tier then never recycles it."""
        with self._lock:
            if not self._open:
                return
            self._open = False
        try:
            self._backend.abort_reserved(self.handle, reusable)
        except Exception:
            log.exception("aborting a reservation failed")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _FastPathStats:
    """Counters of the work done on the thread-safe fast paths (outside the event loop),
    kept under one lock and merged into :meth:`TieredHierarchy.stats`."""

    def __init__(self, ntiers: int) -> None:
        self._lock = threading.Lock()
        self.lookups = 0
        self.puts = 0
        self.rejected_puts = 0
        self.put_bytes = 0
        self.tier_lookups = [0] * ntiers
        self.tier_keys = [0] * ntiers
        self.tier_found = [0] * ntiers
        self.tier_pins = [0] * ntiers

    def count_lookup(self, tier: int, nkeys: int, nfound: int) -> None:
        with self._lock:
            self.tier_lookups[tier] += 1
            self.tier_keys[tier] += nkeys
            self.tier_found[tier] += nfound

    def count_prefix_lookup(self) -> None:
        with self._lock:
            self.lookups += 1

    def count_pins(
        self, grants: Sequence[tuple[CacheEngineKey, tuple[int, float, object]]]
    ) -> None:
        with self._lock:
            for _, (tier, _, _) in grants:
                self.tier_pins[tier] += 1

    def count_puts(self, res: Sequence[bool | None], values: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for r, v in zip(res, values, strict=False):
                if r:
                    self.puts += 1
                    self.put_bytes += _nbytes(v)
                elif r is False:
                    self.rejected_puts += 1

    def add_to_tier(self, index: int, snap: dict[str, Any]) -> None:
        """Add this tier's fast-path counts to its snapshot (same keys as the loop's)."""
        with self._lock:
            for name, counts in (
                ("lookups", self.tier_lookups),
                ("lookup_keys", self.tier_keys),
                ("lookup_found", self.tier_found),
                ("pins", self.tier_pins),
            ):
                if name in snap:
                    snap[name] += counts[index]
            if index == 0:
                snap["stores"] += self.puts
                snap["bytes_in"] += self.put_bytes
                snap["store_failures"] += self.rejected_puts


class TieredHierarchy(BaseBackend):
    """An ordered list of tiers behaving as one backend (see the module docstring)."""

    def __init__(
        self,
        config: CacheConfig | None = None,
        backends: Sequence[Any] | None = None,
        *,
        namespace: Namespace | None = None,
        name: str = "hierarchy",
        content_addressed: bool = False,
    ) -> None:
        """``content_addressed``: the caller's keys name their content (a key stored twice
        holds the same bytes both times, as the vLLM connector's prefix-chained keys do), so
        a write-through store into a tier known to hold the key already is skipped (see
        :meth:`_holds_already`). Off, a later store of a key overwrites it everywhere."""
        cfg = config if config is not None else load_config(None)
        self.content_addressed = content_addressed
        if namespace is None:
            for warning in namespace_warnings(cfg):
                log.warning("%s", warning)
        namespace = resolve_namespace(cfg, namespace)
        super().__init__(cfg, namespace=namespace, name=name)
        self.config = cfg
        if backends is None:
            backends = [t.create_backend(namespace) for t in cfg.tiers]
        if len(backends) != len(cfg.tiers):
            raise ValueError(
                f"{len(cfg.tiers)} tiers configured but {len(backends)} backends given"
            )
        # one thread for the staging copies and the pool's spare faults: together they
        # never take more than one core from the event loop (and it runs at the loop's
        # priority: a niced thread holding the GIL stalls the loop under outside load)
        self.budget = CopyBudget()
        self.pool = StagingPool(background=self.budget.submit)
        self.tiers = [Tier(tc, b, self.pool) for tc, b in zip(cfg.tiers, backends, strict=True)]
        self.capabilities = self._derive_capabilities()  # type: ignore[misc]
        self.leases = LeaseTable()
        self._tier_names = tuple(t.name for t in self.tiers)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self._stats_writer: StatsFileWriter | None = None
        self._lookups = 0
        self._lookup_latency = LatencyReservoir()
        self._fast_lock = threading.Lock()
        self._fast_hits = 0
        self._fast_bytes = 0
        self._eviction_listeners: list[EvictionListener] = []
        self._fast_stats = _FastPathStats(len(self.tiers))
        #: Chain links learned from lookups; ``None`` when no tier has a placement policy.
        self._chains: ChainBook | None = self._attach_placement(cfg)

    def _attach_placement(self, cfg: CacheConfig) -> ChainBook | None:
        """One policy per tier from the ``placement`` section; nothing for ``lru`` or no
        section (every backend keeps its own LRU order: today's behaviour, unchanged)."""
        pl = cfg.placement
        if pl is None or pl.policy == "lru":
            return None
        from ..placement.wiring import ChainBook, TierPlacement, policy_context

        factory = cfg.placement_factory
        if factory is None:  # a CacheConfig built by hand
            from ..plugins import get_registry

            factory = get_registry().policy_factory(pl.policy)
        book = ChainBook(chunk_tokens=cfg.chunk_size)
        for t in self.tiers:
            # sizes as the backend charges them against its bound, when it says
            charge = t.backend.entry_cost if implements(t.backend, EntryCharges) else None
            ctx = policy_context(t.cfg, pl, cfg.chunk_size, charge)
            chooses = not ctx.shared and implements(t.backend, VictimSelection)
            t.placement = TierPlacement(factory(ctx), book, ctx.chunk_bytes, chooses, charge)
        return book

    @classmethod
    def from_config(
        cls,
        config: Any = None,
        *,
        registry: Any = None,
        namespace: Namespace | None = None,
        name: str = "hierarchy",
    ) -> TieredHierarchy:
        """Build from a :class:`CacheConfig`, a mapping, a file path or ``None`` (one cpu
        tier). ``registry`` resolves backend names (default: the process-wide registry).
        ``namespace`` is whose chunks these are: without it, the configuration's
        ``namespace`` section, else the namespace ``default`` (a field set in both must
        agree: :func:`~lmcache_core.config.namespaces.resolve_namespace`). Nothing is opened
        until :meth:`start`."""
        return cls(load_config(config, registry=registry), namespace=namespace, name=name)

    def _derive_capabilities(self) -> Capabilities:
        persistent = any(
            t.backend.capabilities.persistent and t.policy == "through" for t in self.tiers
        )
        shared = self.tiers[0].backend.capabilities.shared
        return Capabilities(persistent=persistent, shared=shared, bounded=False, zero_copy=False)

    def tier(self, name: str) -> Tier:
        """The tier called ``name``."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    # ------------------------------------------------------------------ life cycle
    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        started: list[Tier] = []
        try:
            for t in self.tiers:
                await t.start()
                started.append(t)
        except ConfigError:
            for t in started:
                await t.close(0.0)
            raise
        for i, t in enumerate(self.tiers):
            below = self.tiers[i + 1] if i + 1 < len(self.tiers) else None
            write_back = below if below is not None and below.policy == "back" else None
            if implements(t.backend, EvictionEvents):
                t.backend.set_eviction_listener(self._make_eviction_event(t, write_back))
            if t.placement is not None and t.placement.chooses_victims:
                t.backend.set_victim_selector(t.placement.selector())
        if self.config.stats_dir is not None:
            self._stats_writer = StatsFileWriter(
                self.config.stats_dir, self.config.stats_interval_s, self._stats_document
            )
            self._stats_writer.start()

    async def _close(self) -> None:
        if self._lease_task is not None:
            self._lease_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lease_task
            self._lease_task = None
        self._unpin(self.leases.pop_all())
        deadline = time.monotonic() + self.config.drain_timeout_s
        for t in self.tiers:
            await t.close(max(0.0, deadline - time.monotonic()))
            if implements(t.backend, EvictionEvents):
                t.backend.set_eviction_listener(None)
            if t.placement is not None and t.placement.chooses_victims:
                t.backend.set_victim_selector(None)
        if self._stats_writer is not None:
            await self._stats_writer.stop()
            self._stats_writer = None
        self.budget.close()
        self.pool.close()

    async def flush(self) -> None:
        """Wait until every background store queued so far has finished (in all tiers)."""
        self._check()
        while True:
            for t in self.tiers:
                await t.writer.flush()
            if all(t.writer.depth == 0 for t in self.tiers):
                return

    # ------------------------------------------------------------------ lookups
    async def lookup_prefix(
        self, keys: Sequence[CacheEngineKey], lease_s: float | None = None
    ) -> PrefixLookup:
        """How many leading ``keys`` are available, and where (see :class:`PrefixLookup`).

        With ``lease_s``, the hits are pinned in their tier (where it can pin) until
        :meth:`release` of the same keys or for ``lease_s`` seconds, whichever is first.
        """
        self._check()
        t0 = time.perf_counter()
        n = len(keys)
        holder = [-1] * n
        handles: list[object | None] = [None] * n if lease_s is not None else []
        missing = list(range(n))
        skipped: list[str] = []
        if self._chains is not None:
            self._chains.learn(keys)
        for t in self.tiers:
            if not missing:
                break
            sub = keys if len(missing) == n else [keys[i] for i in missing]
            found = await t.contains_prefix(sub)
            if found is None:
                skipped.append(t.name)
                continue
            if t.placement is not None:
                t.placement.looked_up(sub, found)
            writer = t.writer
            check_pending = writer.depth > 0
            still: list[int] = []
            hits: list[int] = []
            for i, hit in zip(missing, found, strict=True):
                if hit or (check_pending and writer.has(keys[i])):
                    # (a pending store counts: loads read the pending copy)
                    holder[i] = t.index
                    hits.append(i)
                else:
                    still.append(i)
            if lease_s is not None and t.can_pin and hits:
                # pinned before any await: what the check found cannot have gone
                for i, handle in zip(hits, t.pin_many([keys[i] for i in hits]), strict=True):
                    handles[i] = handle
            missing = still
        num_hit = missing[0] if missing else n
        leased = 0
        pinned: tuple[bool, ...] = ()
        if lease_s is not None:
            pinned = tuple(handles[i] is not None for i in range(num_hit))
            expiry = time.monotonic() + lease_s
            extra: list[tuple[int, float, object]] = []
            add = self.leases.add
            for i, handle in enumerate(handles):
                if handle is None:
                    continue
                lease = (holder[i], expiry, handle)
                if i < num_hit:
                    add(keys[i], lease)
                    self.tiers[holder[i]].stats.pins += 1
                    leased += 1
                else:
                    extra.append(lease)
            self._unpin(extra)
            if leased:
                self._ensure_lease_sweeper()
        self._lookups += 1
        self._lookup_latency.add(time.perf_counter() - t0)
        return PrefixLookup(
            num_hit=num_hit,
            tiers=tuple(holder[:num_hit]),
            tier_names=self._tier_names,
            skipped=tuple(skipped),
            leased=leased,
            pinned=pinned,
        )

    async def release(self, keys: Sequence[CacheEngineKey]) -> int:
        """End one lease per key taken by :meth:`lookup_prefix`; returns how many ended.

        After :meth:`close` (which ended every lease) this returns 0 instead of raising, so
        callers finishing requests during shutdown need no special case."""
        if self.closed:
            return 0
        self._check()
        undo = self.leases.release(keys)
        self._unpin(undo)
        return len(undo)

    def _unpin(self, leases: Sequence[tuple[int, float, object]]) -> None:
        by_tier: dict[int, list[object]] = {}
        for idx, _, handle in leases:
            by_tier.setdefault(idx, []).append(handle)
        for idx, handles in by_tier.items():
            self.tiers[idx].unpin_many(handles)

    def _ensure_lease_sweeper(self) -> None:
        if self._state != "started":
            return
        if self._lease_task is None or self._lease_task.done():
            self.leases.arm()
            self._lease_task = asyncio.get_running_loop().create_task(self._sweep_leases())

    async def _sweep_leases(self) -> None:
        while True:
            nxt = self.leases.next_expiry_or_disarm()
            if nxt is None:
                self._lease_task = None
                return
            await asyncio.sleep(max(0.01, nxt - time.monotonic()))
            self._unpin(self.leases.pop_expired(time.monotonic()))

    async def _contains(self, key: CacheEngineKey) -> bool:
        return (await self._batched_contains([key]))[0]

    async def _batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        out = [False] * len(keys)
        missing = list(range(len(keys)))
        for t in self.tiers:
            if not missing:
                break
            found = await t.batched_contains([keys[i] for i in missing])
            if found is None:
                continue
            still = []
            for i, hit in zip(missing, found, strict=True):
                if hit or (t.writer.depth and t.writer.has(keys[i])):
                    out[i] = True
                else:
                    still.append(i)
            missing = still
        return out

    # ------------------------------------------------------------------ loads
    async def _get(self, key: CacheEngineKey) -> torch.Tensor | None:
        return (await self._batched_get([key]))[0]

    async def _batched_get(self, keys: Sequence[CacheEngineKey]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        promote: list[tuple[int, Tier]] = []
        for t in self.tiers:
            if not todo:
                break
            sub = [keys[i] for i in todo]
            values = await t.batched_get(sub)
            still = []
            for i, v in zip(todo, values, strict=True):
                if v is None:
                    v = self._pending_copy(t, keys[i])
                if v is None:
                    t.known.discard(keys[i])
                    still.append(i)
                else:
                    out[i] = v
                    if t.index > 0:
                        promote.append((i, t))
            todo = still
        for i, t in promote:
            value = out[i]
            assert value is not None
            await self._promote(keys[i], value, t)
        return out

    async def _get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        src = await self._find_into(key, out)
        if src is not None and src.index > 0:
            await self._promote(key, out, src)
        return src is not None

    async def _find_into(self, key: CacheEngineKey, out: torch.Tensor) -> Tier | None:
        """Load ``key`` into ``out`` from the first tier holding it; that tier, or ``None``."""
        for t in self.tiers:
            if await t.get_into(key, out) or self._pending_into(t, key, out):
                return t
            t.known.discard(key)  # (a miss: whatever we believed, the tier lacks it now)
        return None

    async def get_into_deferred(
        self, key: CacheEngineKey, out: torch.Tensor
    ) -> tuple[bool, Promotion | None]:
        """:meth:`get_into`, leaving the promotion of a lower tier's hit to the caller.

        Returns whether ``key`` was loaded and, for a hit that :meth:`get_into` would
        have promoted, ``promote``: await ``promote()`` on this hierarchy's loop while
        ``out`` still holds the chunk (it copies from ``out``), after whatever the caller
        wants done first (the vLLM connector copies the chunk into vLLM's blocks and
        reports it before promoting); not calling it promotes nothing.
        ``promote(on_top_stored=fn)``: ``fn(ok)`` runs on the loop once the top tier's
        background store of the chunk ran (never when the top tier does not take it)."""
        self._check()
        _check_key(key)
        _check_out(out)
        src = await self._find_into(key, out)
        self._count_read(src is not None, _nbytes(out) if src is not None else 0)
        if src is None or src.index == 0:
            return src is not None, None
        if not self._served(key, src):
            return True, None
        return True, functools.partial(self._copy_up, key, out, src)

    def _holds_already(self, t: Tier, key: CacheEngineKey) -> bool:
        """Whether a write-through store of ``key`` into ``t`` can be skipped (keys that
        name their content only): a store of it is queued, or ``t`` stored or served it in
        this process and still holds it by its own in-memory answer
        (``try_batched_contains_threadsafe``: the disk tier's view of its shared index,
        so a chunk another process removed through the index is written again). A tier
        that cannot answer from memory is written. A file removed behind the index's back
        is a stale positive until a load misses it (the load then drops the row)."""
        if t.writer.queued(key):
            t.stats.known_skips += 1
            return True
        if key not in t.known:
            return False
        if self._contains_in_tier_threadsafe(t, [key]) == [True]:
            t.stats.known_skips += 1
            return True
        t.known.discard(key)
        return False

    async def _batched_get_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool]:
        hits = [False] * len(keys)
        todo = list(range(len(keys)))
        promote: list[tuple[int, Tier]] = []
        for t in self.tiers:
            if not todo:
                break
            res = await t.batched_get_into([keys[i] for i in todo], [outs[i] for i in todo])
            still = []
            for i, hit in zip(todo, res, strict=True):
                if hit or self._pending_into(t, keys[i], outs[i]):
                    hits[i] = True
                    if t.index > 0:
                        promote.append((i, t))
                else:
                    t.known.discard(keys[i])
                    still.append(i)
            todo = still
        for i, t in promote:
            await self._promote(keys[i], outs[i], t)
        return hits

    def _pending_copy(self, t: Tier, key: CacheEngineKey) -> torch.Tensor | None:
        """A copy of a chunk waiting in ``t``'s store queue (not yet in the tier)."""
        value = t.writer.peek(key)
        if value is None:
            return None
        out = torch.empty(value.shape, dtype=value.dtype)
        copy_tensor(out, value)
        return out

    def _pending_into(self, t: Tier, key: CacheEngineKey, out: torch.Tensor) -> bool:
        value = t.writer.peek(key)
        if value is None or value.dtype != out.dtype or value.shape != out.shape:
            return False
        copy_tensor(out, value)
        return True

    async def _promote(self, key: CacheEngineKey, value: torch.Tensor, src: Tier) -> None:
        """Note ``src``'s hit and, if its tier promotes, copy the chunk up (:meth:`_copy_up`)."""
        if self._served(key, src):
            await self._copy_up(key, value, src)

    @staticmethod
    def _served(key: CacheEngineKey, src: Tier) -> bool:
        """Note that ``src`` served ``key``; whether ``src``'s hits are promoted."""
        src.known.add(key)
        return src.cfg.promote

    async def _copy_up(
        self,
        key: CacheEngineKey,
        value: torch.Tensor,
        src: Tier,
        on_top_stored: Callable[[bool], None] | None = None,
    ) -> None:
        """Copy a chunk found in ``src`` into the top tier and the through tiers above ``src``;
        ``on_top_stored(ok)`` once the top tier's store ran (see :meth:`Tier.enqueue`; not
        called when the top tier does not take the chunk)."""
        nbytes = _nbytes(value)
        targets = [
            t
            for t in self.tiers[: src.index]
            if (t.index == 0 or t.policy == "through")
            and t.placement_admits(key, nbytes)
            and t.accepting()
        ]
        if not targets:
            return
        if targets[0].index == 0 and await self._promote_reserved(key, value, on_top_stored):
            targets = targets[1:]  # the top tier holds it now (the listener heard)
            if not targets:
                return
        chunk = await self._stage(value)
        for t in targets:
            t.enqueue(key, chunk, "promote", on_top_stored if t.index == 0 else None)
        chunk.release()

    async def _promote_reserved(
        self,
        key: CacheEngineKey,
        value: torch.Tensor,
        on_top_stored: Callable[[bool], None] | None,
    ) -> bool:
        """Promote ``value`` into memory the top tier already has (a recycled buffer, so no
        fresh page faults: a staged copy would take a buffer of the hierarchy's pool, which
        the top tier then keeps, so the pool faults in new memory for every promoted chunk)
        and publish it there at once. ``False``, with nothing done, when the top tier has no
        recycled buffer of this size to lend (or cannot lend): the caller stages a copy."""
        if not value.is_contiguous() or value.device.type != "cpu":
            return False
        res = self.reserve_in_top_threadsafe(value.dtype, value.shape, fresh=False)
        if res is None:
            return False
        top = self.tiers[0]
        nbytes = _nbytes(value)
        stored = False
        try:
            await self.budget.copy(res.value, value)
            # (no admission check: a staged promotion's store never had one either)
            stored, _ = top.commit_reserved(key, res.handle, nbytes, False)
            res.ended()
        except asyncio.CancelledError:
            res.abort(reusable=False)  # the copy's thread may still write into it
            raise
        finally:
            res.abort()  # (a no-op once committed)
        if stored:
            top.stats.promotions += 1
            top.known.add(key)
        if on_top_stored is not None:
            notify_stored([on_top_stored], key, stored)
        return True

    async def _stage(self, value: torch.Tensor) -> StagedChunk:
        buf = self.pool.take_like(value)
        try:
            if value.is_contiguous():
                await self.budget.copy(buf, value)
            else:
                buf.copy_(value)
        except asyncio.CancelledError:
            raise  # a thread may still write into buf: never recycle it
        except BaseException:
            self.pool.give(buf)
            raise
        return StagedChunk(buf, self.pool)

    # ------------------------------------------------------------------ stores
    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        if value.device.type != "cpu":
            # One host copy, made after the caller's queued work that makes the value;
            # every tier and every background store then reads host memory (a device
            # tensor queued for a write-through would be read later, unordered).
            value = await asyncio.to_thread(host_copy, ready_event(value), value)
            donate = True
        top = self.tiers[0]
        nbytes = _nbytes(value)
        lower = self._through_targets(key, nbytes)
        stored = False
        if top.admits(key, nbytes):
            stored = await top.put_now(key, value, donate and not lower)
        if lower:
            chunk = StagedChunk(value, None) if donate else await self._stage(value)
            for t in lower:
                t.enqueue(key, chunk, "through")
            chunk.release()
        return stored

    # ------------------------------------------------------------------ reserved stores
    def reserve_in_top_threadsafe(
        self, dtype: torch.dtype, shape: Sequence[int], fresh: bool = True
    ) -> Reservation | None:
        """Memory of the top tier for one chunk of ``dtype``/``shape``, for the caller to
        fill from its own thread and then store with :meth:`put_reserved` (or give back
        with :meth:`Reservation.abort`): the chunk is then written once, into memory the top
        tier keeps, and write-through tiers read that same memory instead of a staging
        copy. ``None`` when the top tier cannot lend (no
        :class:`~lmcache_core.interface.ReservedPuts`, a codec, failing, a placement
        policy or a ``back`` tier below: evictions from a thread would need them) or has
        no room (with ``fresh=False``: no recycled memory at hand); the caller then
        stores with ``put``. Nothing is visible to any lookup or load before the commit.
        """
        top = self._plain_top(ReservedPuts)
        if (
            top is None
            or not top.started
            or top.health.consecutive_errors
            or top.placement is not None
            or any(t.policy == "back" for t in self.tiers[1:])
        ):
            return None
        try:
            res = top.backend.try_reserve_threadsafe(dtype, shape, fresh)
        except Exception:
            return None
        if res is None:
            return None
        handle, value = res
        return Reservation(value, handle, top.backend)

    async def put_reserved(self, key: CacheEngineKey, res: Reservation) -> bool:
        """Store a filled reservation under ``key`` (:meth:`reserve_in_top_threadsafe`): like
        ``put`` of ``res.value``, without its copies. The top tier publishes the memory
        itself; each write-through tier gets a background store reading that memory,
        borrowed from the top tier (never evicted, recycled or overwritten in place until
        the last such store ended). When the top tier does not store it (not admitted, an
        error) the write-through tiers get a staged copy, as ``put`` gives them, and the
        reservation is aborted. The reservation ends here in every case, a call cancelled
        while it runs included (one cancelled before it started never saw it: the
        caller aborts it then; an abort is a no-op once ended). The caller must not write
        into ``res.value`` any more."""
        try:
            self._check()
            _check_put_key(key)
            return await self._put_reserved(key, res)
        except asyncio.CancelledError:
            res.abort(reusable=False)  # a staging copy may still read it
            raise
        finally:
            res.abort()

    def _through_targets(self, key: CacheEngineKey, nbytes: int) -> list[Tier]:
        """The write-through tiers a store of ``key`` goes to (admission recorded)."""
        return [
            t
            for t in self.tiers[1:]
            if t.policy == "through"
            and not (self.content_addressed and self._holds_already(t, key))
            and t.admits(key, nbytes)
            and t.accepting()
        ]

    async def _put_reserved(self, key: CacheEngineKey, res: Reservation) -> bool:
        top = self.tiers[0]
        value = res.value
        nbytes = _nbytes(value)
        lower = self._through_targets(key, nbytes)
        stored, borrow = False, None
        if top.admits(key, nbytes):
            stored, borrow = top.commit_reserved(key, res.handle, nbytes, bool(lower))
            res.ended()
        self._count_reserved_put(stored, nbytes)
        if lower:
            if borrow is not None:
                chunk = StagedChunk(value, None, self._borrow_ender(top, borrow))
            else:
                chunk = await self._stage(value)
            for t in lower:
                t.enqueue(key, chunk, "through")
            chunk.release()
        return stored

    def _count_reserved_put(self, stored: bool, nbytes: int) -> None:
        if stored:
            self._stats.puts += 1
            self._stats.bytes_written += nbytes
        else:
            self._stats.rejected_puts += 1

    @staticmethod
    def _borrow_ender(tier: Tier, handle: object) -> Callable[[], None]:
        def end() -> None:
            try:
                tier.backend.end_borrows([handle])
            except Exception:  # never break a store's clean-up
                log.exception("tier %r: ending a write-through borrow failed", tier.name)

        return end

    def add_eviction_listener(self, listener: EvictionListener) -> Callable[[], None]:
        """Call ``listener(tier_name, key)`` after each capacity eviction in any tier that
        reports evictions; returns a function that unsubscribes it.

        Listeners run in the thread that evicted (usually the IO loop's), must be quick
        and never raise (an exception is logged and ignored); they get no tensor."""
        self._eviction_listeners.append(listener)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._eviction_listeners.remove(listener)

        return remove

    def _make_eviction_event(self, tier: Tier, write_back: Tier | None) -> Any:
        """The one eviction listener installed on ``tier``'s backend: fans the event out to
        every subscriber, then hands the value to write-back (which may take it)."""
        back = self._make_write_back(write_back) if write_back is not None else None
        name = tier.name

        placement = tier.placement

        def on_evict(key: CacheEngineKey, value: torch.Tensor) -> bool:
            if placement is not None:
                placement.removed(key)
            for listener in tuple(self._eviction_listeners):
                try:
                    listener(name, key)
                except Exception:  # a subscriber must never break eviction
                    log.exception("eviction listener failed for %s", key)
            return bool(back(key, value)) if back is not None else False

        return on_evict

    def _make_write_back(self, target: Tier) -> Any:
        """The eviction listener of the tier above ``target`` (its tensor is only valid
        during the call: copy it)."""

        def on_evict(key: CacheEngineKey, value: torch.Tensor) -> bool:
            if self._state != "started":
                return False
            if key in target.known or target.writer.queued(key):
                target.stats.known_skips += 1
                return False
            if not target.admits(key, _nbytes(value)) or not target.accepting():
                return False
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._loop:
                # Take the evicted buffer itself (the tier above lets go of it): no copy.
                chunk = StagedChunk(value, None)
                target.enqueue(key, chunk, "back")
                chunk.release()
                return True
            if self._loop is not None:  # evicted from another thread: copy, hand to the loop
                buf = self.pool.take_like(value)
                copy_tensor(buf, value)
                staged = StagedChunk(buf, self.pool)

                def enqueue() -> None:
                    target.enqueue(key, staged, "back")
                    staged.release()

                self._loop.call_soon_threadsafe(enqueue)
            return False

        return on_evict

    async def _remove(self, key: CacheEngineKey) -> bool:
        removed = False
        for t in self.tiers:
            if await t.remove(key):
                removed = True
        return removed

    # ------------------------------------------------------------------ fast path
    def _top_for_thread_loads(self, capability: type[Any]) -> Tier | None:
        """The top tier when it may serve loads from the calling thread through
        ``capability`` (a declared protocol of :mod:`lmcache_core.interface`): started,
        implementing it, without a codec (coded chunks are decoded on a thread, by the
        tier), without a load deadline and healthy; else ``None`` (the async path)."""
        top = self._plain_top(capability)
        if top is None or top.load_deadline is not None or not top.health.usable():
            return None
        return top

    def _plain_top(self, capability: type[Any]) -> Tier | None:
        """The top tier of a started hierarchy when it implements ``capability`` and has no
        codec (what every thread-side path needs; each adds its own conditions)."""
        if self._state != "started":
            return None
        top = self.tiers[0]
        if not implements(top.backend, capability) or top.codec is not None:
            return None
        return top

    def _count_fast_hits(self, served: Sequence[torch.Tensor]) -> None:
        """Count chunks served (copied or lent) from the calling thread."""
        if served:
            nbytes = sum(_nbytes(t) for t in served)
            with self._fast_lock:
                self._fast_hits += len(served)
                self._fast_bytes += nbytes

    def try_get_into_threadsafe(self, key: CacheEngineKey, out: torch.Tensor) -> bool | None:
        """Serve a top-tier hit from the calling thread; ``None``: use the async path.

        Safe from any thread; used by :class:`~lmcache_core.SyncBackend`. Only a hit in a
        healthy top tier without a load deadline is served here.
        """
        res = self.try_batched_get_into_threadsafe([key], [out])
        return None if res is None else res[0]

    def try_batched_get_into_threadsafe(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool | None] | None:
        """Per key: ``True`` when served from the top tier here, ``None`` when the async
        path must decide; ``None`` overall when nothing could be served."""
        top = self._top_for_thread_loads(ThreadSafeLoads)
        if top is None:
            return None
        try:
            res = top.backend.try_batched_get_into_threadsafe(keys, outs)
        except Exception:
            return None  # the async path will see (and count) the problem
        if res is None:
            return None
        out: list[bool | None] = [True if r else None for r in res]
        self._count_fast_hits([o for r, o in zip(res, outs, strict=True) if r])
        return out

    # ------------------------------------------------------------------ borrows
    def try_borrow_threadsafe(
        self, keys: Sequence[CacheEngineKey]
    ) -> list[tuple[object, torch.Tensor] | None] | None:
        """Read-only views of ``keys``' chunks in the top tier, borrowed from the calling
        thread (see :class:`~lmcache_core.interface.ThreadSafeBorrows`): per key
        ``(handle, view)`` or ``None`` (not in the top tier); ``None`` overall when the
        top tier cannot lend (no such capability, a load deadline, unhealthy, an error).
        End every borrow with :meth:`end_borrows` after the last read of its view."""
        top = self._top_for_thread_loads(ThreadSafeBorrows)
        if top is None:
            return None
        try:
            res: list[tuple[object, torch.Tensor] | None] | None = (
                top.backend.try_borrow_threadsafe(keys)
            )
        except Exception:
            return None  # the copying path will see (and count) the problem
        if res is None:
            return None
        self._count_fast_hits([r[1] for r in res if r is not None])
        return res

    def end_borrows(self, handles: Sequence[object]) -> None:
        """End borrows taken by :meth:`try_borrow_threadsafe`."""
        if not handles:
            return
        top = self.tiers[0]
        if implements(top.backend, ThreadSafeBorrows):
            top.backend.end_borrows(handles)

    # ------------------------------------------------------------------ thread-safe lookups
    def try_batched_contains_threadsafe(
        self, keys: Sequence[CacheEngineKey]
    ) -> list[bool | None] | None:
        """``batched_contains`` from the calling thread, tier by tier while the tiers can
        answer without the event loop (``cpu`` can); ``None`` for the keys left undecided
        by a tier that cannot (the async path asks again), ``None`` overall when nothing
        was decided. A store still queued for a tier counts as present, as on the loop.
        A race with a store moving through a tier's queue can only make this miss a key,
        never invent one. See :class:`~lmcache_core.interface.ThreadSafeLookups`."""
        if self._state != "started":
            return None
        out: list[bool | None] = [False] * len(keys)
        missing = list(range(len(keys)))
        for t in self.tiers:
            if not missing:
                break
            sub = keys if len(missing) == len(keys) else [keys[i] for i in missing]
            found = self._contains_in_tier_threadsafe(t, sub)
            if found is None:
                if t.index == 0:
                    return None
                for i in missing:
                    out[i] = None
                return out
            still = []
            for i, hit in zip(missing, found, strict=True):
                if hit:
                    out[i] = True
                else:
                    still.append(i)
            missing = still
        return out

    def _contains_in_tier_threadsafe(
        self, t: Tier, keys: Sequence[CacheEngineKey]
    ) -> list[bool] | None:
        """Which ``keys`` tier ``t`` holds or has a store of pending, asked from this
        thread; ``None`` when the tier cannot answer so now."""
        fast = self._fast_tiers_for(t)
        if fast is None:
            return None
        pending = self._pending_keys(t, keys)
        try:
            found = fast(keys)
        except Exception:
            return None
        if found is None or None in found:
            return None
        self._fast_stats.count_lookup(t.index, len(keys), found.count(True))
        if pending is not None:
            return [bool(f) or p for f, p in zip(found, pending, strict=True)]
        return found  # type: ignore[no-any-return]

    def _fast_tiers_for(self, t: Tier) -> Any:
        """``t``'s ``try_batched_contains_threadsafe`` when it may be called now, else ``None``."""
        fast = (
            t.backend.try_batched_contains_threadsafe
            if implements(t.backend, ThreadSafeContains)
            else None
        )
        if fast is None or not t.started or t.health.consecutive_errors:
            return None
        return fast

    @staticmethod
    def _pending_keys(t: Tier, keys: Sequence[CacheEngineKey]) -> list[bool] | None:
        """Which keys have a store queued or running for ``t`` (read before the tier, so a
        store that finishes in between is seen in one place or the other)."""
        writer = t.writer
        if not writer.depth:
            return None
        return [writer.has(k) for k in keys]

    def _threadsafe_pins(self, blocking: bool = True) -> bool:
        """Whether every tier that pins does so safely from any thread (a backend with a
        thread-safe lookup fast path has thread-safe ``pin``/``unpin`` too, as
        :class:`~lmcache_core.interface.ThreadSafeContains` says); with ``blocking=False``,
        also without I/O that may wait (a backend whose pins are index transactions
        declares it: :func:`~lmcache_core.interface.pins_do_io`, as the disk backend)."""
        return all(
            not t.can_pin
            or (
                implements(t.backend, ThreadSafeContains)
                and (blocking or not pins_do_io(t.backend))
            )
            for t in self.tiers
        )

    @property
    def observes_accesses(self) -> bool:
        """Whether some tier has a placement policy (then :meth:`observe_prefix` matters)."""
        return self._chains is not None

    def observe_prefix(self, keys: Sequence[CacheEngineKey]) -> None:
        """Tell the placement policies that a request asked for ``keys`` (a prompt's
        chunks in chain order, from its first), from the calling thread: the chain is
        learned and each in-process tier with a policy records one access per key, hit
        or miss by what the tier holds now. Nothing is pinned, loaded or counted.

        For callers that decide hits without :meth:`lookup_prefix` (the vLLM connector's
        workers load memory-tier hits the scheduler planned from its own index): without
        this their policies would see neither the misses nor the chain. A no-op without
        a placement policy; tiers that cannot answer from a thread (shared ones) are
        skipped: their policies see the lookups that reach them."""
        chains = self._chains
        if chains is None or not keys or self._state != "started":
            return
        chains.learn(keys)
        for t in self.tiers:
            pl = t.placement
            if pl is None or not pl.chooses_victims:
                continue
            fast = self._fast_tiers_for(t)
            if fast is None:
                continue
            try:
                found = fast(keys)
            except Exception:
                continue
            if found is not None and None not in found:
                pl.looked_up(keys, found)

    def try_lookup_prefix_threadsafe(
        self, keys: Sequence[CacheEngineKey], lease_s: float | None = None
    ) -> PrefixLookup | None:
        """:meth:`lookup_prefix` from the calling thread, without the event loop; ``None``
        when a tier that must be asked cannot answer from a thread (then nothing was
        pinned: the caller uses the async path).

        Same result and lease semantics as :meth:`lookup_prefix`: with ``lease_s`` the
        hits are pinned in their tier (the pin is the presence check, so what was found
        cannot have gone), and the lease-expiry sweeper is started on the loop when it is
        not running."""
        if self._state != "started":
            return None
        if lease_s is not None and not self._threadsafe_pins():
            return None
        n = len(keys)
        holder = [-1] * n
        handles: list[object | None] = [None] * n if lease_s is not None else []
        taken: list[tuple[int, float, object]] = []
        missing = list(range(n))
        if self._chains is not None:
            self._chains.learn(keys)
        fs = self._fast_stats
        for t in self.tiers:
            if not missing:
                break
            fast = self._fast_tiers_for(t)
            if fast is None:
                self._unpin(taken)
                return None
            sub = keys if len(missing) == n else [keys[i] for i in missing]
            pending = self._pending_keys(t, sub)
            pins: list[object | None] | None = None
            try:
                if lease_s is not None and t.can_pin:
                    pins = t.pin_many(sub)
                    found: list[bool | None] | None = [h is not None for h in pins]
                else:
                    found = fast(sub)
            except Exception:
                found = None
            if found is None or None in found:
                self._unpin(taken)
                return None
            if t.placement is not None:
                t.placement.looked_up(sub, found)
            fs.count_lookup(t.index, len(sub), found.count(True))
            still = []
            for j, (i, hit) in enumerate(zip(missing, found, strict=True)):
                if pins is not None and pins[j] is not None:
                    handles[i] = pins[j]
                    taken.append((t.index, 0.0, pins[j]))
                if hit or (pending is not None and pending[j]):
                    holder[i] = t.index
                else:
                    still.append(i)
            missing = still
        num_hit = missing[0] if missing else n
        leased = 0
        pinned: tuple[bool, ...] = ()
        if lease_s is not None:
            pinned = tuple(handles[i] is not None for i in range(num_hit))
            expiry = time.monotonic() + lease_s
            extra: list[tuple[int, float, object]] = []
            grant: list[tuple[CacheEngineKey, tuple[int, float, object]]] = []
            for i, handle in enumerate(handles):
                if handle is None:
                    continue
                lease = (holder[i], expiry, handle)
                if i < num_hit:
                    grant.append((keys[i], lease))
                else:
                    extra.append(lease)
            self._unpin(extra)
            leased = len(grant)
            if grant:
                fs.count_pins(grant)
                if self.leases.add_many(grant):
                    self._start_sweeper_threadsafe()
        fs.count_prefix_lookup()
        return PrefixLookup(
            num_hit=num_hit,
            tiers=tuple(holder[:num_hit]),
            tier_names=self._tier_names,
            skipped=(),
            leased=leased,
            pinned=pinned,
        )

    def _start_sweeper_threadsafe(self) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._ensure_lease_sweeper)
        except RuntimeError:  # the loop has stopped: close() ended (or will end) every lease
            pass

    def try_release_threadsafe(
        self, keys: Sequence[CacheEngineKey], blocking: bool = True
    ) -> int | None:
        """:meth:`release` from the calling thread; ``None`` when a tier's pins are not
        safe from a thread (or the hierarchy is not started): use the async path. With
        ``blocking=False`` also ``None`` when undoing a pin may wait for I/O (a caller
        that must not stall, such as vLLM's engine thread, then releases on the loop)."""
        if self._state != "started" or not self._threadsafe_pins(blocking):
            return None
        undo = self.leases.release(keys)
        self._unpin(undo)
        return len(undo)

    # ------------------------------------------------------------------ thread-safe stores
    def try_batched_put_threadsafe(
        self,
        keys: Sequence[CacheEngineKey],
        values: Sequence[torch.Tensor],
        donate: bool = False,
    ) -> list[bool | None] | None:
        """``batched_put`` from the calling thread when the whole store is the top tier's:
        it stores from a thread (``cpu`` does), admits every key (``admit_after: 1``) and
        no tier below is written on a put or on its evictions (no ``through`` or ``back``
        tier). Otherwise ``None``: the async path stores (one loop hop per batch)."""
        if self._state != "started":
            return None
        top = self.tiers[0]
        fast = (
            top.backend.try_batched_put_threadsafe
            if implements(top.backend, ThreadSafePuts)
            else None
        )
        if (
            fast is None
            or top.codec is not None
            or not top.started
            or top.health.consecutive_errors
            or top.cfg.admit_after > 1
            or top.placement is not None
            or any(t.policy in ("through", "back") for t in self.tiers[1:])
        ):
            return None
        try:
            res: list[bool | None] | None = fast(keys, values, donate)
        except Exception:
            return None  # the async path will see (and count) the problem
        if res is not None:
            self._fast_stats.count_puts(res, values)
        return res

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, Any]:
        """Hierarchy totals plus a ``tiers`` list with each tier's statistics."""
        d = super().stats()
        with self._fast_lock:
            fast_hits, fast_bytes = self._fast_hits, self._fast_bytes
        d["hits"] += fast_hits
        d["bytes_read"] += fast_bytes
        d["threadsafe_hits"] = fast_hits
        fast_stats = self._fast_stats
        d["lookups"] = self._lookups + fast_stats.lookups
        d["threadsafe_lookups"] = fast_stats.lookups
        d["puts"] += fast_stats.puts
        d["rejected_puts"] += fast_stats.rejected_puts
        d["bytes_written"] += fast_stats.put_bytes
        d["lookup_latency"] = self._lookup_latency.as_dict()
        d["namespace"] = namespace_label(self.namespace)
        d["leases"] = len(self.leases)
        d["pending_stores"] = sum(t.writer.depth for t in self.tiers)
        tiers = []
        for t in self.tiers:
            snap = t.snapshot()
            if t.index == 0:
                snap["hits"] += fast_hits
                snap["bytes_out"] += fast_bytes
            fast_stats.add_to_tier(t.index, snap)
            tiers.append(snap)
        d["tiers"] = tiers
        return d

    def _stats_document(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "config": self.config.to_dict(redact=True),
            "stats": self.stats(),
        }
