"""Opening the tiered storage for the connector's processes.

Each **worker** process opens the full hierarchy from the configuration (its CPU tier is
process-local memory; disk/S3 tiers are shared). The **scheduler** process cannot read a
worker's memory, so it opens a *lookup view*: the same configuration restricted to the
tiers other processes can see (``capabilities.shared``: disk, S3, ...), used only for
``lookup_prefix``. Together with what the workers report having stored, that tells the
scheduler what every rank can load.

Both are driven from vLLM's synchronous threads through one :class:`~lmcache_core.SyncBackend`
each (an IO event-loop thread per process).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ...blob import lower_thread_priority
from ...config import CacheConfig, load_config
from ...hierarchy.tiered import PrefixLookup, Reservation, TieredHierarchy
from ...keys import CacheEngineKey, Namespace
from ...sync import SyncBackend

__all__ = [
    "COPY_THREAD_PREFIX",
    "Lookup",
    "Storage",
    "load_storage_config",
    "pinned_keys",
    "replica_storage_config",
]

log = logging.getLogger("vllm.lmcache_core.storage")
#: Name prefix of the worker storage's copy threads (see ``Storage(copy_nice=...)``).
COPY_THREAD_PREFIX = "lmcache-copy"


T = TypeVar("T")


def load_storage_config(raw: dict[str, Any], source: str = "") -> CacheConfig:
    """Validate the storage configuration (raises ``ConfigError`` naming the bad field)."""
    cfg = load_config(raw)
    if source and not cfg.source:
        cfg = dataclasses.replace(cfg, source=source)
    return cfg


def _shared(tier: Any) -> bool:
    caps = tier.capabilities  # the declared Capabilities (None: class not imported)
    return caps is not None and bool(caps.shared)


def replica_storage_config(config: CacheConfig) -> tuple[CacheConfig, bool]:
    """The storage of a rank whose KV another rank of its replica group also holds (MLA
    at tensor parallel > 1): it keeps writing its own memory tier (private, so no other
    rank can serve it), while the shared tiers are written by the group's first rank
    only and read by all (one copy per chunk). Returns the configuration and whether
    this rank must not store at all (its first tier is shared)."""
    tiers = list(config.tiers)
    if not tiers or _shared(tiers[0]):
        return config, True
    out = [tiers[0]] + [
        dataclasses.replace(t, write_policy="none") if _shared(t) else t for t in tiers[1:]
    ]
    return dataclasses.replace(config, tiers=tuple(out)), False


@dataclass(frozen=True)
class Lookup:
    """Leading keys available, the name of the tier holding each, and the keys this
    lookup pinned (the only ones its caller may release)."""

    num_hit: int
    tiers: tuple[str, ...]
    pinned: tuple[CacheEngineKey, ...] = ()


def pinned_keys(keys: Sequence[CacheEngineKey], res: PrefixLookup) -> list[CacheEngineKey]:
    """The keys ``res`` (a lookup of ``keys``) pinned. Release only these:
    :meth:`TieredHierarchy.release` ends one lease per key whoever took it, so releasing a
    hit this lookup did not pin would end another caller's lease."""
    return [k for k, p in zip(keys[: res.num_hit], res.pinned, strict=False) if p]


class Storage:
    """A started hierarchy plus the blocking calls the connector needs."""

    def __init__(
        self,
        config: CacheConfig,
        namespace: Namespace,
        *,
        shared_only: bool = False,
        timeout_s: float | None = None,
        copy_nice: int = 0,
    ) -> None:
        if shared_only:
            tiers = [
                t for t in config.tiers if t.capabilities is not None and t.capabilities.shared
            ]
            config = dataclasses.replace(
                config,
                tiers=tuple(dataclasses.replace(t, index=i) for i, t in enumerate(tiers)),
                stats_dir=None,
            )
        self.config = config
        self.tier_names = tuple(t.name for t in config.tiers)
        self.drain_timeout_s = float(config.drain_timeout_s)
        # (prefix-chained chunk keys name their content: no tier rewrites a chunk it holds)
        self.hierarchy = TieredHierarchy(
            config, namespace=namespace, name="vllm-connector", content_addressed=True
        )
        backend: Any = self.hierarchy
        self.sync = SyncBackend(backend, timeout=timeout_s)
        self._install_copy_threads(copy_nice)
        self.sync.start()
        _close_before_thread_pools_stop(self)

    def _install_copy_threads(self, nice: int) -> None:
        """The IO loop's helper threads (``asyncio.to_thread``: the memory tier's copies of
        stored and promoted chunks): four, named ``COPY_THREAD_PREFIX``, ``nice`` steps
        below the process. The loop itself (lookups, load completions) keeps its
        priority. ``nice`` is 0 by default (``copy_nice``): the threads run Python, and a
        niced one holding the GIL while vLLM's compute threads or other processes keep
        the cores busy stalls vLLM's engine thread and this loop (see
        :func:`lmcache_core.blob.lower_thread_priority`)."""
        pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=4,
            thread_name_prefix=COPY_THREAD_PREFIX,
            initializer=lower_thread_priority,
            initargs=(nice,),
        )

        async def install() -> None:
            asyncio.get_running_loop().set_default_executor(pool)

        self.sync.io.run(install())

    @classmethod
    def lookup_view(
        cls, config: CacheConfig, namespace: Namespace, timeout_s: float | None = None
    ) -> Storage | None:
        """The shared tiers of ``config`` for scheduler-side lookups, or ``None`` if none."""
        if not any(t.capabilities is not None and t.capabilities.shared for t in config.tiers):
            return None
        return cls(config, namespace, shared_only=True, timeout_s=timeout_s)

    # ------------------------------------------------------------------ top tier
    @property
    def top_is_private_memory(self) -> bool:
        """Whether the first tier is this process's memory (not shared, not persistent)."""
        caps = self.hierarchy.tiers[0].backend.capabilities
        return not (caps.shared or caps.persistent)

    @property
    def top_max_bytes(self) -> int | None:
        """Capacity of the first tier when it declares one."""
        n = getattr(self.hierarchy.tiers[0].backend, "max_bytes", None)
        return int(n) if isinstance(n, int) else None

    def on_top_eviction(self, listener: Callable[[CacheEngineKey], None]) -> None:
        """Call ``listener(key)`` after the first tier evicts ``key`` (from any thread)."""
        top = self.tier_names[0]

        def relay(tier: str, key: CacheEngineKey) -> None:
            if tier == top:
                listener(key)

        self.hierarchy.add_eviction_listener(relay)

    def pin_top(self, keys: Sequence[CacheEngineKey]) -> list[object | None]:
        """Pin ``keys`` in the first tier (``None`` where absent or not pinnable)."""
        return self.hierarchy.tiers[0].pin_many(keys)

    def unpin_top(self, handles: Sequence[object]) -> None:
        self.hierarchy.tiers[0].unpin_many(handles)

    def get_into_memory(self, keys: Sequence[CacheEngineKey], outs: Sequence[Any]) -> list[bool]:
        """Loads served by the first tier from the calling thread only (a miss there is a
        miss: never a wait on a slower tier)."""
        res = self.hierarchy.try_batched_get_into_threadsafe(keys, outs)
        if res is None:
            return [False] * len(keys)
        return [bool(r) for r in res]

    def borrow_from_memory(
        self, keys: Sequence[CacheEngineKey]
    ) -> list[tuple[object, Any] | None] | None:
        """Read-only views of ``keys``' chunks in the first tier, from the calling thread
        (``None`` per key not there; ``None`` overall when the tier cannot lend): the
        caller copies straight out of the tier and must end every borrow with
        :meth:`end_borrows` after its last read."""
        return self.hierarchy.try_borrow_threadsafe(keys)

    def end_borrows(self, handles: Sequence[object]) -> None:
        """End borrows taken by :meth:`borrow_from_memory`."""
        self.hierarchy.end_borrows(handles)

    def reserve_in_memory(self, dtype: torch.dtype, shape: Sequence[int]) -> Reservation | None:
        """Recycled memory of the first tier for one chunk (already faulted in: never
        fresh memory, whose page faults would then land on the caller's thread), to
        gather into and store with ``hierarchy.put_reserved``; ``None`` when the tier
        cannot lend or has none at hand (store a buffer of your own then)."""
        return self.hierarchy.reserve_in_top_threadsafe(dtype, shape, fresh=False)

    # ------------------------------------------------------------------ blocking calls
    def lookup(self, keys: Sequence[CacheEngineKey], lease_s: float | None = None) -> Lookup:
        """How many leading ``keys`` some tier holds (pinned for ``lease_s`` when given).

        Blocking: answered in the calling thread when every tier asked can answer from a
        thread (``cpu``), else in one hop to the IO loop (SyncBackend's fast path)."""
        if not keys:
            return Lookup(0, ())
        res = self.sync.lookup_prefix(keys, lease_s=lease_s)
        return Lookup(
            res.num_hit,
            tuple(res.tier_of(i) for i in range(res.num_hit)),
            tuple(pinned_keys(keys, res)),
        )

    def release(self, keys: Sequence[CacheEngineKey]) -> int:
        """End one lease per key (pass only keys a lookup pinned, e.g. ``Lookup.pinned``);
        how many ended. Blocking, through SyncBackend's thread-safe fast path when the
        tiers allow."""
        return self.sync.release(keys) if keys else 0

    def get_into(self, keys: Sequence[CacheEngineKey], outs: Sequence[Any]) -> list[bool]:
        """Load each key into its buffer; ``False`` for a miss (never raises for a miss)."""
        return self.sync.batched_get_into(keys, outs)

    def put(self, keys: Sequence[CacheEngineKey], values: Sequence[Any]) -> list[bool]:
        """Store the chunks (copied: the caller may reuse the buffers afterwards)."""
        return self.sync.batched_put(keys, values)

    # ------------------------------------------------------------------ background calls
    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the IO loop without waiting."""
        return self.sync.io.submit(coro)

    def lookup_ranks(
        self, keys_by_rank: Sequence[Sequence[CacheEngineKey]], lease_s: float | None
    ) -> concurrent.futures.Future[list[PrefixLookup]]:
        """One background prefix lookup per rank's key list, all at once."""

        async def run() -> list[PrefixLookup]:
            return list(
                await asyncio.gather(
                    *(self.hierarchy.lookup_prefix(k, lease_s=lease_s) for k in keys_by_rank)
                )
            )

        return self.submit(run())

    def release_soon(self, keys: Sequence[CacheEngineKey]) -> None:
        """End leases on ``keys`` (only keys a lookup pinned) without waiting: in the
        calling thread when the tiers' unpins are thread-safe and do no I/O (no event-loop
        hop), else on the IO loop in the background. Never raises."""
        if not keys:
            return
        keys = list(keys)
        if not self.sync.io.in_loop_thread():
            try:
                # never an index transaction on vLLM's thread: disk unpins go to the loop
                if self.hierarchy.try_release_threadsafe(keys, blocking=False) is not None:
                    return
            except Exception as exc:  # fall back to the loop, which logs what it finds
                log.debug("thread-safe release failed (%s); releasing on the IO loop", exc)
        try:
            self.submit(self.hierarchy.release(keys))
        except RuntimeError:  # the IO loop has stopped: the leases ended with it
            pass

    def get_into_async(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[Any]
    ) -> concurrent.futures.Future[list[bool]]:
        """Background ``batched_get_into`` through every tier."""
        return self.submit(self.hierarchy.batched_get_into(list(keys), list(outs)))

    def put_async(self, key: CacheEngineKey, value: Any) -> concurrent.futures.Future[bool]:
        """Background store (into the first tier, then down by policy); ``True`` once the
        first tier holds it. ``value`` must stay untouched until the future is done."""
        return self.submit(self.hierarchy.put(key, value))

    def stats(self) -> dict[str, Any]:
        return self.hierarchy.stats()

    def tier_health(self) -> dict[str, bool]:
        """Per tier: whether it answers (not in error back-off)."""
        return {t.name: t.health.state == "ok" for t in self.hierarchy.tiers}

    def clear_private(self, timeout_s: float = 60.0) -> int:
        """Remove every chunk from the tiers no other process sees (the memory tier);
        shared tiers are untouched. Returns how many chunks were removed. Blocking."""
        tiers = [
            t
            for t in self.hierarchy.tiers
            if not t.backend.capabilities.shared and hasattr(t.backend, "keys")
        ]

        async def run() -> int:
            n = 0
            for t in tiers:
                for key in list(t.backend.keys()):
                    n += int(await t.remove(key))
            return n

        return int(self.submit(run()).result(timeout=timeout_s)) if tiers else 0

    def purge_shared(self, namespace_json: str, timeout_s: float = 600.0) -> int:
        """Delete every chunk of ``namespace_json`` from the shared tiers that can be
        scanned (``MaintainableBackend``). Returns how many were deleted. Blocking."""
        from ...interface import MaintainableBackend, implements
        from ...keys import CacheEngineKey

        tiers = [
            t
            for t in self.hierarchy.tiers
            if t.backend.capabilities.shared and implements(t.backend, MaintainableBackend)
        ]

        async def run() -> int:
            n = 0
            for t in tiers:
                doomed = [
                    e
                    async for e in t.backend.scan(read_headers=True)
                    if e.namespace == namespace_json
                ]
                for e in doomed:
                    try:  # through the tier (it forgets what it knew of the key)
                        n += int(await t.remove(CacheEngineKey.from_string(e.key or "")))
                    except ValueError:
                        n += int(await t.backend.delete_entry(e))
            return n

        return int(self.submit(run()).result(timeout=timeout_s)) if tiers else 0

    def close(self) -> None:
        """Finish queued stores (up to the configured drain timeout) and close. Idempotent."""
        try:
            self.sync.close()
        except Exception as exc:  # closing must never break vLLM's shutdown
            log.warning("LMCacheCoreConnector: closing the storage failed: %s", exc)


def _close_before_thread_pools_stop(storage: Storage) -> None:
    """Close ``storage`` at interpreter exit *before* ``concurrent.futures`` stops its
    threads: queued write-through stores (to disk, S3) need them to finish. vLLM closes
    the connector itself on a normal engine shutdown; this covers an in-process engine
    left to the interpreter's exit."""
    ref = weakref.ref(storage)

    def close() -> None:
        s = ref()
        if s is not None:
            s.close()

    register = getattr(threading, "_register_atexit", None)
    try:
        # Called in reverse order of registration: after concurrent.futures' own hook
        # was registered (at its import), ours runs first.
        register(close)  # type: ignore[misc]
    except Exception:  # pragma: no cover - other Python implementations
        atexit.register(close)
