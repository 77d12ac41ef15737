"""The ``disk`` backend: a persistent, crash-safe, checksummed tier shared by processes.

* One object file per chunk (the lmcache-core object format, data at a 4 KiB offset) at
  ``<path>/ns2-<namespace digest>/ab/<32 hex>`` (256 shard directories; a namespace that
  older versions wrote keeps their ``ns-<digest>/ab/cd/<32 hex>``: :mod:`.layout`);
  directories 0700, files 0600 by default.
* Puts (:mod:`.store`) reserve room in the shared index, write a temporary file, rename it
  into place and record it atomically: a process killed at any instant leaves the old
  object, the new one, or none. What dead writers leave is settled by :mod:`.recovery`.
* Gets (here) verify size, header, identity and checksum; a bad object is a miss, and is
  removed and counted. Readers hold a shared ``flock``, so eviction skips what is read.
* All file and index work runs in a pool of ``concurrency`` threads (measured faster than
  aiofiles, see ``docs/backends/disk.md``); the event loop only schedules.
* Maintenance (scan / verify / delete / reconcile) is in :mod:`.maint`, cross-process pins
  in :mod:`.pins`.
* The directory is a sandbox (:mod:`.sandbox`): every path below the root is reached
  relative to the root's descriptor without following any symbolic link, and a root that
  another user controls is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import itertools
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from lmcache_core.backend import BaseBackend, Capabilities
from lmcache_core.blob import lower_thread_priority
from lmcache_core.config.options import build_options
from lmcache_core.cuda_sync import ready_event, wait_ready
from lmcache_core.errors import ConfigError, LMCacheError
from lmcache_core.keys import CacheEngineKey, Namespace

from . import layout
from .aligned import (
    ALIGN,
    BufferPool,
    auto_stage_over_bytes,
    probe_direct_io,
    probe_direct_mem_align,
)
from .flusher import Flusher
from .index import IndexUnavailable
from .maint import DiskMaintenance
from .objects import ObjectIO, ReadOutcome, ReadResult
from .options import DiskOptions, dir_mode, parse_mode
from .owners import OWNERS, OwnerLock, new_owner_id
from .pins import DiskPins
from .recovery import DiskRecovery
from .sandbox import TierDir, open_root
from .shared_index import SharedIndex
from .state import Counters
from .store import DiskStore
from .view import KeyView

__all__ = ["DiskBackend", "DiskTierError"]

log = logging.getLogger("lmcache_core.disk")
T = TypeVar("T")

_KEY_TYPES = {CacheEngineKey}
#: Seconds after which an idle staging buffer is released.
STAGING_IDLE_S = 30.0


class DiskTierError(LMCacheError, OSError):
    """The tier cannot start (a read-only or full filesystem, no permission, ...): the
    message says what failed where and what to do."""


class DiskBackend(DiskStore, DiskRecovery, DiskMaintenance, DiskPins, BaseBackend):
    """Local-directory tier (backend name ``disk``). See the module docstring."""

    Options = DiskOptions
    capabilities = Capabilities(persistent=True, shared=True, bounded=True, zero_copy=False)
    interface_version = "1.0"  # the lmcache_core.interface version it implements

    def __init__(
        self, options: Any = None, *, namespace: Namespace | None = None, name: str | None = None
    ) -> None:
        opts = build_options(DiskOptions, options)
        super().__init__(opts, namespace=namespace, name=name or "disk")
        self.opts = opts
        self.root = os.path.abspath(opts.path)
        self.max_bytes = opts.max_bytes
        self.file_mode = parse_mode(opts.mode)
        self.dir_mode = dir_mode(self.file_mode)
        self.owner = new_owner_id()
        self.direct_io = False
        self.direct_mem_align = ALIGN  # memory alignment O_DIRECT needs (probed at start)
        self.batch_concurrency = opts.concurrency
        self._ns_json = layout.namespace_json(namespace)
        self._ns_dir = layout.namespace_dir(self._ns_json)
        self._ns_ready = False
        self._ns_lock = threading.Lock()
        self._bound_recorded = False
        self._seq = itertools.count()
        self._exec: concurrent.futures.ThreadPoolExecutor | None = None
        self._index: SharedIndex | None = None
        self._view: KeyView | None = None
        self._io: ObjectIO | None = None
        self._owner_lock: OwnerLock | None = None
        self._tier: TierDir | None = None
        self._buffers = BufferPool(opts.staging_bytes, STAGING_IDLE_S)
        self._flusher = Flusher(f"lmcache-{self.name}")
        self._touches: dict[str, float] = {}
        self._touch_lock = threading.Lock()
        self._last_flush = 0.0
        self._totals = (0, 0)
        self._unpin_later: list[int] = []
        self._unpin_lock = threading.Lock()
        self._heal_lock = threading.Lock()
        self._heal_thread: threading.Thread | None = None
        self._heal_timer: threading.Timer | None = None
        self._closing = False
        self._last_audit = time.monotonic()
        self._last_owner_check = time.monotonic()
        self.counters = Counters()

    # ================================================================== plumbing
    @property
    def meta_dir(self) -> str:
        return os.path.join(self.root, layout.META_DIR)

    @property
    def tier(self) -> TierDir:
        """The root directory's descriptor-relative, link-free access (after start)."""
        assert self._tier is not None
        return self._tier

    def _abs(self, rel: str) -> str:
        """The path of ``rel`` as text (for messages and tests; I/O goes through :attr:`tier`)."""
        return os.path.join(self.root, rel)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` in the I/O pool and return its result (see :meth:`_await_all`)."""
        assert self._exec is not None
        return (await self._await_all([self._exec.submit(fn, *args)]))[0]

    async def _await_all(self, futs: Sequence[concurrent.futures.Future[T]]) -> list[T]:
        """Results of pool jobs, in order. A thread cannot be stopped: if the caller is
        cancelled, wait for every job to finish before re-raising, so no caller buffer is
        touched afterwards and no reservation is left behind."""
        if not futs:
            return []
        afuts = [asyncio.wrap_future(f) for f in futs]
        waiter = asyncio.ensure_future(asyncio.wait(afuts))
        cancelled = False
        while not waiter.done():
            try:
                await asyncio.shield(waiter)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            for a in afuts:
                if not a.cancelled():
                    a.exception()  # retrieved: no "never retrieved" warnings
            raise asyncio.CancelledError
        return [a.result() for a in afuts]

    async def _run_batch(self, fn: Callable[..., T], calls: Sequence[tuple[Any, ...]]) -> list[T]:
        """``[fn(*args) for args in calls]`` run concurrently in the pool; the job that
        finishes last resolves one future, so the event loop wakes once per batch."""
        if len(calls) <= 1:
            return [await self._call(fn, *args) for args in calls]
        done: concurrent.futures.Future[list[T]] = concurrent.futures.Future()
        results: list[Any] = [None] * len(calls)
        errors: list[BaseException] = []
        left = [len(calls)]
        lock = threading.Lock()

        def one(i: int, args: tuple[Any, ...]) -> None:
            try:
                results[i] = fn(*args)
            except BaseException as exc:
                errors.append(exc)
            finally:
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    if errors:
                        done.set_exception(errors[0])
                    else:
                        done.set_result(results)

        for i, args in enumerate(calls):
            self._submit_or_run(one, i, args)
        return (await self._await_all([done]))[0]

    def _submit_or_run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` in the pool, or run it here if the pool is shutting down."""
        assert self._exec is not None
        try:
            self._exec.submit(fn, *args)
        except RuntimeError:
            fn(*args)

    @property
    def index(self) -> SharedIndex:
        assert self._index is not None
        return self._index

    @property
    def io(self) -> ObjectIO:
        assert self._io is not None
        return self._io

    # ================================================================== life cycle
    async def _start(self) -> None:
        self._exec = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.opts.concurrency,
            thread_name_prefix=f"lmcache-{self.name}",
            initializer=lower_thread_priority,
            initargs=(self.opts.io_nice,),
        )
        try:
            await self._call(self._start_guarded)
            await self._warm_pool()
        except BaseException:
            await asyncio.get_running_loop().run_in_executor(None, self._shutdown_sync)
            raise

    async def _warm_pool(self) -> None:
        """Start every I/O thread now: a thread started under load waits for the GIL, which
        would delay the first operations of a burst by milliseconds each."""
        assert self._exec is not None
        n = self.opts.concurrency
        barrier = threading.Barrier(n)

        def meet() -> None:
            try:
                barrier.wait(timeout=5.0)
            except threading.BrokenBarrierError:
                pass

        await self._await_all([self._exec.submit(meet) for _ in range(n)])

    def _start_guarded(self) -> None:
        """:meth:`_start_sync`, its storage errors turned into a :class:`DiskTierError`
        that says what to do."""
        try:
            self._start_sync()
        except (ConfigError, DiskTierError):
            raise
        except (OSError, sqlite3.Error) as exc:
            raise DiskTierError(_start_error(self.root, exc)) from exc

    def _start_sync(self) -> None:
        durable = self.opts.fsync
        self._tier = open_root(self.root, self.dir_mode, self.file_mode, durable=durable)
        tier = self._tier
        # layout 1 for a namespace an older version has written here, else layout 2
        self._ns_dir = layout.pick_namespace_dir(tier, self._ns_json)
        new_dirs = self._make_meta_dirs()
        if durable:
            for d in new_dirs:
                tier.fsync_dir(d)
        self._owner_lock = OwnerLock(tier, self.owner, self.file_mode)
        if self.opts.direct_io != "false":
            with tier.dir(layout.META_DIR) as meta_fd:
                self.direct_io = probe_direct_io(meta_fd, f".probe-{self.owner}")
                if self.direct_io:
                    self.direct_mem_align = probe_direct_mem_align(meta_fd, f".probe-{self.owner}")
            if not self.direct_io and self.opts.direct_io == "true":
                raise ConfigError(
                    f"the filesystem of {self.root} refuses O_DIRECT", "options.direct_io"
                )
        self._io = ObjectIO(
            tier,
            self.file_mode,
            self.dir_mode,
            direct=self.direct_io,
            durable=durable,
            pool=self._buffers,
            mem_align=self.direct_mem_align,
            reads_in_flight=self.opts.reads_in_flight,
            stage_small_pages=self._stage_small_pages() if self.direct_io else 0,
            stage_page_aligned=self.opts.small_pages == "stage",
        )
        self._index = SharedIndex(tier, self.file_mode, on_damage=self._index_damaged)
        self._view = KeyView(self._index, self._ns_dir, self.opts.lookup_refresh_s)
        with self._index_lock():
            self._open_index_locked()
        self._reap_sync()
        with self.index.snapshot() as tx:
            self._totals = tx.totals()
        self._view.current()  # loaded here, in a pool thread, not by the first lookup

    def _stage_small_pages(self) -> int:
        """The ``small_pages`` option for this tier's device: stage aligned tensors in small
        pages larger than this many bytes (0: never; ``auto``: larger than one device
        request carries from such pages, see :func:`.aligned.auto_stage_over_bytes`)."""
        mode = self.opts.small_pages
        if mode != "auto":
            return ALIGN if mode == "stage" else 0  # stage: all over one page
        try:
            return auto_stage_over_bytes(os.stat(self.root).st_dev)
        except OSError:
            return 0

    def _make_meta_dirs(self) -> list[str]:
        """Create ``.lmcache-disk/owners`` (links or files in their place are removed),
        checking each level before going into it; the parents to fsync."""
        umask = layout.current_umask()
        new_dirs = self.tier.make_dirs(layout.META_DIR, self.dir_mode, umask)
        self._check_meta_dir(layout.META_DIR)
        new_dirs += self.tier.make_dirs(OWNERS, self.dir_mode, umask)
        self._check_meta_dir(OWNERS)
        return new_dirs

    def _check_meta_dir(self, rel: str) -> None:
        """``rel`` must not be writable by every user (ours is fixed; another user's is
        refused, naming the fix)."""
        with self.tier.dir(rel) as fd:
            st = os.fstat(fd)
            if not st.st_mode & 0o002:
                return
            if st.st_uid == os.geteuid():
                os.fchmod(fd, self.dir_mode)
                return
        raise ConfigError(
            f"refusing tier {self.root}: {rel} is writable by every user and belongs to "
            f"uid {st.st_uid}; its owner should run `chmod o-w {self._abs(rel)}`",
            "options.path",
        )

    async def _close(self) -> None:
        try:
            await self._call(self._flush_touches_sync, True)
            await self._call(self._drop_own_pins_sync)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self._shutdown_sync)

    def _shutdown_sync(self) -> None:
        self._stop_healing()
        if self._exec is not None:
            self._exec.shutdown(wait=True)
        self._flusher.close()
        if self._index is not None:
            self._index.close()
        if self._owner_lock is not None:
            self._owner_lock.release()
        self._buffers.clear()
        if self._tier is not None:
            self.counters.links_removed = self._tier.links_removed
            self._tier.close()

    # ================================================================== reads
    def _rel(self, key: CacheEngineKey) -> str:
        view = self._view
        if view is None:
            return layout.object_relpath(self._ns_dir, key)
        return f"{self._ns_dir}/{view.location(key)}"

    def try_batched_contains_threadsafe(
        self, keys: Sequence[CacheEngineKey]
    ) -> list[bool | None] | None:
        """``batched_contains`` from any thread, answered from the in-memory view of the
        shared index (:mod:`.view`); ``None`` when the view cannot answer now (the index
        is being rebuilt): the async path then checks the files. A positive is a hint:
        a load that finds no valid object is a miss. See
        :class:`~lmcache_core.interface.ThreadSafeContains` (the pin methods are thread-safe
        too: they take the index's lock)."""
        view = self._view
        if view is None or not self.started:
            return None
        if keys and set(map(type, keys)) != _KEY_TYPES:  # the async path raises the error
            return None
        return view.contains_many(keys)  # type: ignore[return-value]

    async def _contains(self, key: CacheEngineKey) -> bool:
        return (await self._batched_contains([key]))[0]

    async def _batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        view = self._view
        found = view.contains_many(keys) if view is not None else None
        if found is not None:
            return found
        rels = [self._rel(k) for k in keys]
        step = max(16, -(-len(rels) // self.opts.concurrency))  # cold stats in parallel
        parts = await self._run_batch(
            self._exists_sync, [(rels[i : i + step],) for i in range(0, len(rels), step)]
        )
        return [hit for part in parts for hit in part]

    def _exists_sync(self, rels: list[str]) -> list[bool]:
        exists = self.tier.exists
        return [exists(rel) for rel in rels]

    async def _get(self, key: CacheEngineKey) -> torch.Tensor | None:
        return await self._call(self._get_sync, key)

    async def _get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        ready = ready_event(out)  # a CUDA buffer: after the caller's queued work on it
        if ready is not None:
            return await self._call(self._get_into_when_ready, ready, key, out)
        return await self._call(self._get_into_sync, key, out)

    def _get_into_when_ready(self, ready: Any, key: CacheEngineKey, out: torch.Tensor) -> bool:
        wait_ready(ready, out.device)
        return self._get_into_sync(key, out)

    async def _batched_get(self, keys: Sequence[CacheEngineKey]) -> list[torch.Tensor | None]:
        return await self._run_batch(self._get_sync, [(k,) for k in keys])

    async def _batched_get_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool]:
        ready = ready_event(*outs)
        if ready is not None:
            args = [(ready, k, o) for k, o in zip(keys, outs, strict=True)]
            return await self._run_batch(self._get_into_when_ready, args)
        return await self._run_batch(self._get_into_sync, list(zip(keys, outs, strict=True)))

    def _get_sync(self, key: CacheEngineKey) -> torch.Tensor | None:
        rel = self._rel(key)
        try:
            res = self.io.read_new(rel, key.to_string(), self._ns_json)
        except OSError as exc:
            self._read_error(rel, exc)
            return None
        return res.tensor if self._settle_read(rel, res) else None

    def _get_into_sync(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        rel = self._rel(key)
        try:
            res = self.io.read_into(rel, key.to_string(), self._ns_json, out)
        except OSError as exc:
            self._read_error(rel, exc)
            return False
        return self._settle_read(rel, res)

    def _read_error(self, rel: str, exc: OSError) -> None:
        self.counters.read_errors += 1
        self._stats.errors += 1
        log.warning("disk tier %s: reading %s failed: %s", self.root, rel, exc)

    def _settle_read(self, rel: str, res: ReadResult) -> bool:
        """Book-keeping after a read: touch a hit, remove a bad object."""
        if res.outcome is ReadOutcome.HIT:
            self._touch(rel)
            return True
        if self._view is not None:
            self._view.invalidate()  # a lookup may have said "stored": catch up at once
        if res.outcome is ReadOutcome.MISSING:
            self._forget_missing_sync(rel)
        elif res.outcome is ReadOutcome.BUSY:
            self.counters.busy_misses += 1
        elif res.outcome is ReadOutcome.LINK:
            self.counters.bad_objects += 1
            log.warning(
                "disk tier %s: a symbolic link is planted at %s; removing it", self.root, rel
            )
            self._remove_link_sync(rel)
        elif res.outcome is ReadOutcome.BAD:
            self.counters.bad_objects += 1
            log.warning(
                "disk tier %s: %s is unusable (%s); removing it", self.root, rel, res.reason
            )
            self._remove_bad_sync(rel, res.inode)
        return False

    def _forget_missing_sync(self, rel: str) -> None:
        """Drop the index row of an object whose file is gone.

        A process killed while evicting (file unlinked, index transaction not committed)
        leaves such a row; it would count against ``max_bytes`` forever. Plain misses
        cost one read-only lookup; only a stale row takes the write lock."""
        try:
            with self.index.snapshot() as tx:
                if tx.entry_size(rel) is None:
                    return
            with self.index.transaction() as tx:
                if self.tier.lstat(rel) is None and tx.delete_entry(rel):
                    self.counters.stale_rows_removed += 1
                self._totals = tx.totals()
        except IndexUnavailable:
            self.counters.index_unavailable += 1
        except (OSError, sqlite3.Error) as exc:
            self.counters.index_errors += 1
            log.warning("disk tier %s: could not drop the row of %s: %s", self.root, rel, exc)

    def _remove_bad_sync(self, rel: str, inode: tuple[int, int] | None) -> None:
        """Remove ``rel`` if it is still the very file found bad (not a fresh replacement)."""
        try:
            with self.index.transaction() as tx:
                st = self.tier.lstat(rel)
                if st is None:
                    tx.delete_entry(rel)
                    return
                if inode is None or (st.st_dev, st.st_ino) == inode:
                    self.tier.unlink(rel)
                    tx.delete_entry(rel)
                    self.counters.bad_removed += 1
                self._totals = tx.totals()
        except IndexUnavailable:
            self.counters.index_unavailable += 1
        except (OSError, sqlite3.Error) as exc:
            self.counters.index_errors += 1
            log.warning("disk tier %s: could not remove bad object %s: %s", self.root, rel, exc)

    def _remove_link_sync(self, rel: str) -> None:
        """Remove the links planted on the way to ``rel`` (the links, never their targets)
        and the index row of ``rel``."""
        try:
            self.tier.remove_links(rel)
            with self.index.transaction() as tx:
                tx.delete_entry(rel)
                self._totals = tx.totals()
        except IndexUnavailable:
            self.counters.index_unavailable += 1
        except (OSError, sqlite3.Error) as exc:
            self.counters.index_errors += 1
            log.warning("disk tier %s: could not remove the link at %s: %s", self.root, rel, exc)

    # ------------------------------------------------------------------ LRU touches
    def _touch(self, rel: str) -> None:
        now = time.time()
        with self._touch_lock:
            self._touches[rel] = now
            due = now - self._last_flush >= self.opts.touch_interval
        if due:
            self._flush_touches_sync(False)

    def _take_touches(self) -> list[tuple[str, float]]:
        with self._touch_lock:
            items = list(self._touches.items())
            self._touches.clear()
            self._last_flush = time.time()
        return items

    def _flush_touches_sync(self, final: bool) -> None:
        items = self._take_touches()
        if not items or self._index is None or self._index.unavailable is not None:
            return  # (read times are dropped while the index is rebuilt)
        try:
            with self.index.transaction() as tx:
                tx.touch(items)
        except sqlite3.Error as exc:
            self.counters.index_errors += 1
            if final:
                log.warning("disk tier %s: could not record read times: %s", self.root, exc)

    # ================================================================== removal
    async def _remove(self, key: CacheEngineKey) -> bool:
        return await self._call(self._remove_rel_sync, self._rel(key))

    def _remove_rel_sync(self, rel: str) -> bool:
        """Remove the object at ``rel`` and its row. A storage error (a read-only
        filesystem, no permission) is logged and counted, never raised: ``False``."""
        if not layout.is_object_relpath(rel):
            raise ValueError(f"{rel!r} is not an object location of a disk tier")
        try:
            try:
                with self.index.transaction() as tx:
                    removed = self.tier.unlink(rel)
                    tx.delete_entry(rel)
                    self._totals = tx.totals()
            except sqlite3.Error as exc:
                self.counters.index_errors += 1
                log.warning(
                    "disk tier %s: index update for removing %s failed: %s", self.root, rel, exc
                )
                return self.tier.unlink(rel)
        except OSError as exc:
            self.counters.remove_failures += 1
            self._stats.errors += 1
            log.warning("disk tier %s: removing %s failed: %s", self.root, rel, exc)
            return False
        return removed

    # ================================================================== introspection
    def _usage(self) -> dict[str, Any]:
        c = self.counters
        return {
            "path": self.root,
            "used_bytes": self._totals[0],
            "entries": self._totals[1],
            "max_bytes": self.max_bytes,
            "direct_io": self.direct_io,
            "direct_io_mem_align": self.direct_mem_align,
            "stage_small_pages": bool(self._io is not None and self._io.stage_small_pages),
            "stage_small_pages_over_bytes": self._io.stage_small_pages if self._io else 0,
            "small_page_stagings": self._io.small_page_stagings if self._io is not None else 0,
            "evictions": c.evictions,
            "evicted_bytes": c.evicted_bytes,
            "bad_objects": c.bad_objects,
            "bad_removed": c.bad_removed,
            "stale_rows_removed": c.stale_rows_removed,
            "busy_misses": c.busy_misses,
            "store_failures": c.store_failures,
            "full_rejections": c.full_rejections,
            "index_errors": c.index_errors,
            "read_errors": c.read_errors,
            "reaped_owners": c.reaped_owners,
            "removed_temps": c.removed_temps,
            "pins": c.pins,
            "pin_failures": c.pin_failures,
            "remove_failures": c.remove_failures,
            "index_rebuilds": c.index_rebuilds,
            "index_heals": c.index_heals,
            "index_unavailable": c.index_unavailable,
            "links_removed": c.links_removed
            + (self._tier.links_removed if self._tier is not None else 0),
            "staging_idle_bytes": self._buffers.idle_bytes,
        }


_HINTS = {
    errno.EROFS: "the filesystem is mounted read-only: mount it read-write, or point `path` "
    "at a writable directory",
    errno.ENOSPC: "the filesystem is full: free some space (or run `lmcache-core gc`), or "
    "point `path` at another filesystem",
    errno.EDQUOT: "the disk quota is exhausted: free some space, or point `path` elsewhere",
    errno.EACCES: "permission denied: check the owner and mode of the directory (see the "
    "disk backend's docs, 'The tier directory is a sandbox')",
    errno.EPERM: "operation not permitted: check the owner and mode of the directory",
}
_SQLITE_HINTS = {
    8: errno.EROFS,  # SQLITE_READONLY
    13: errno.ENOSPC,  # SQLITE_FULL
    14: errno.EACCES,  # SQLITE_CANTOPEN
}


def _start_error(root: str, exc: BaseException) -> str:
    """The message of a :class:`DiskTierError` for ``exc`` raised while starting."""
    code = getattr(exc, "errno", None)
    if isinstance(exc, sqlite3.Error):
        code = _SQLITE_HINTS.get((getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF, code)
    where = getattr(exc, "filename", None)
    what = f"{exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}"
    at = f" ({where})" if where else ""
    hint = _HINTS.get(code or 0, "see the message above")
    return f"disk tier {root} cannot start: {what}{at}; {hint}"
