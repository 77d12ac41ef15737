"""The ``disk`` backend: a persistent, crash-safe, checksummed tier shared by processes.

* One object file per chunk (the lmcache-core object format, data at a 4 KiB offset) at
  ``<path>/ns-<namespace digest>/<key.to_path()>``; directories 0700, files 0600 by default.
* Puts (:mod:`.store`) reserve room in the shared index, write a temporary file, rename it
  into place and record it atomically: a process killed at any instant leaves the old
  object, the new one, or none. What dead writers leave is settled by :mod:`.recovery`.
* Gets (here) verify size, header, identity and checksum; a bad object is a miss, and is
  removed and counted. Readers hold a shared ``flock``, so eviction skips what is read.
* All file and index work runs in a pool of ``concurrency`` threads (measured faster than
  aiofiles, see ``docs/backends/disk.md``); the event loop only schedules.
* Maintenance (scan / verify / delete / reconcile) is in :mod:`.maint`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import itertools
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from lmcache_core.backend import BaseBackend, Capabilities
from lmcache_core.errors import ConfigError
from lmcache_core.keys import CacheEngineKey, Namespace
from lmcache_core.options import build_options

from . import layout
from .aligned import BufferPool, probe_direct_io
from .index import SharedIndex
from .maint import DiskMaintenance
from .objects import ObjectIO, ReadOutcome, ReadResult
from .options import DiskOptions, dir_mode, parse_mode
from .owners import OwnerLock, new_owner_id
from .pins import DiskPins
from .recovery import DiskRecovery
from .state import Counters, unlink_quiet
from .store import DiskStore

__all__ = ["DiskBackend"]

log = logging.getLogger("lmcache_core.disk")
T = TypeVar("T")

#: Idle O_DIRECT staging buffers kept for reuse, per backend.
STAGING_POOL_BYTES = 1 << 30
_EVICT_BATCH = 64


class DiskBackend(DiskStore, DiskRecovery, DiskMaintenance, DiskPins, BaseBackend):
    """Local-directory tier (backend name ``disk``). See the module docstring."""

    Options = DiskOptions
    capabilities = Capabilities(persistent=True, shared=True, bounded=True, zero_copy=False)

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
        self.batch_concurrency = opts.concurrency
        self._ns_json = layout.namespace_json(namespace)
        self._ns_dir = layout.namespace_dir(self._ns_json)
        self._ns_ready = False
        self._ns_lock = threading.Lock()
        self._bound_recorded = False
        self._seq = itertools.count()
        self._exec: concurrent.futures.ThreadPoolExecutor | None = None
        self._index: SharedIndex | None = None
        self._io: ObjectIO | None = None
        self._owner_lock: OwnerLock | None = None
        self._buffers = BufferPool(STAGING_POOL_BYTES)
        self._touches: dict[str, float] = {}
        self._touch_lock = threading.Lock()
        self._last_flush = 0.0
        self._totals = (0, 0)
        self._unpin_later: list[int] = []
        self._unpin_lock = threading.Lock()
        self.counters = Counters()

    # ================================================================== plumbing
    @property
    def meta_dir(self) -> str:
        return os.path.join(self.root, layout.META_DIR)

    def _abs(self, rel: str) -> str:
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
            initializer=_lower_thread_priority,
            initargs=(self.opts.io_nice,),
        )
        try:
            await self._call(self._start_sync)
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

    def _start_sync(self) -> None:
        durable = self.opts.fsync
        layout.make_dirs(self.root, self.dir_mode, durable=durable)
        owners = os.path.join(self.meta_dir, layout.OWNERS_DIR)
        layout.make_dirs(owners, self.dir_mode, durable=durable)
        self._owner_lock = OwnerLock(self.root, self.owner, self.file_mode)
        if self.opts.direct_io != "false":
            self.direct_io = probe_direct_io(self.meta_dir, f".probe-{self.owner}")
            if not self.direct_io and self.opts.direct_io == "true":
                raise ConfigError(
                    f"the filesystem of {self.root} refuses O_DIRECT", "options.direct_io"
                )
        self._io = ObjectIO(
            self.root,
            self.file_mode,
            self.dir_mode,
            direct=self.direct_io,
            durable=durable,
            pool=self._buffers,
        )
        self._index = SharedIndex(os.path.join(self.meta_dir, layout.INDEX_FILE), self.file_mode)
        lock_fd = os.open(
            os.path.join(self.meta_dir, layout.INDEX_LOCK),
            os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
            self.file_mode,
        )
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            if not self._index.open():
                self._rebuild_sync()
        finally:
            os.close(lock_fd)  # releases the flock
        self._reap_sync()
        with self.index.snapshot() as tx:
            self._totals = tx.totals()

    async def _close(self) -> None:
        try:
            await self._call(self._flush_touches_sync, True)
            await self._call(self._drop_own_pins_sync)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self._shutdown_sync)

    def _shutdown_sync(self) -> None:
        if self._exec is not None:
            self._exec.shutdown(wait=True)
        if self._index is not None:
            self._index.close()
        if self._owner_lock is not None:
            self._owner_lock.release()
        self._buffers.clear()

    # ================================================================== reads
    def _rel(self, key: CacheEngineKey) -> str:
        return layout.object_relpath(self._ns_dir, key)

    async def _contains(self, key: CacheEngineKey) -> bool:
        return (await self._call(self._exists_sync, [self._rel(key)]))[0]

    async def _batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        rels = [self._rel(k) for k in keys]
        step = max(16, -(-len(rels) // self.opts.concurrency))  # cold stats in parallel
        parts = await self._run_batch(
            self._exists_sync, [(rels[i : i + step],) for i in range(0, len(rels), step)]
        )
        return [hit for part in parts for hit in part]

    def _exists_sync(self, rels: list[str]) -> list[bool]:
        out = []
        for rel in rels:
            try:
                out.append(stat.S_ISREG(os.lstat(self._abs(rel)).st_mode))
            except OSError:
                out.append(False)
        return out

    async def _get(self, key: CacheEngineKey) -> torch.Tensor | None:
        return await self._call(self._get_sync, key)

    async def _get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        return await self._call(self._get_into_sync, key, out)

    async def _batched_get(self, keys: Sequence[CacheEngineKey]) -> list[torch.Tensor | None]:
        return await self._run_batch(self._get_sync, [(k,) for k in keys])

    async def _batched_get_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool]:
        return await self._run_batch(self._get_into_sync, list(zip(keys, outs, strict=True)))

    def _get_sync(self, key: CacheEngineKey) -> torch.Tensor | None:
        rel = self._rel(key)
        try:
            res = self.io.read_new(self._abs(rel), key.to_string(), self._ns_json)
        except OSError as exc:
            self._read_error(rel, exc)
            return None
        return res.tensor if self._settle_read(rel, res) else None

    def _get_into_sync(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        rel = self._rel(key)
        try:
            res = self.io.read_into(self._abs(rel), key.to_string(), self._ns_json, out)
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
        if res.outcome is ReadOutcome.MISSING:
            self._forget_missing_sync(rel)
        elif res.outcome is ReadOutcome.BUSY:
            self.counters.busy_misses += 1
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
                if not os.path.lexists(self._abs(rel)) and tx.delete_entry(rel):
                    self.counters.stale_rows_removed += 1
                self._totals = tx.totals()
        except sqlite3.Error as exc:
            self.counters.index_errors += 1
            log.warning("disk tier %s: could not drop the row of %s: %s", self.root, rel, exc)

    def _remove_bad_sync(self, rel: str, inode: tuple[int, int] | None) -> None:
        """Remove ``rel`` if it is still the very file found bad (not a fresh replacement)."""
        path = self._abs(rel)
        try:
            with self.index.transaction() as tx:
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    tx.delete_entry(rel)
                    return
                if inode is None or (st.st_dev, st.st_ino) == inode:
                    os.unlink(path)
                    tx.delete_entry(rel)
                    self.counters.bad_removed += 1
                self._totals = tx.totals()
        except (OSError, sqlite3.Error) as exc:
            self.counters.index_errors += 1
            log.warning("disk tier %s: could not remove bad object %s: %s", self.root, rel, exc)

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
        if not items or self._index is None:
            return
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
        if not layout.is_object_relpath(rel):
            raise ValueError(f"{rel!r} is not an object location of a disk tier")
        path = self._abs(rel)
        try:
            with self.index.transaction() as tx:
                removed = unlink_quiet(path)
                tx.delete_entry(rel)
                self._totals = tx.totals()
        except sqlite3.Error as exc:
            self.counters.index_errors += 1
            log.warning(
                "disk tier %s: index update for removing %s failed: %s", self.root, rel, exc
            )
            return unlink_quiet(path)
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
        }


def _lower_thread_priority(increment: int) -> None:
    """Make the calling (I/O) thread nicer by ``increment`` (Linux: per thread)."""
    if increment <= 0:
        return
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + increment))
    except (OSError, AttributeError):
        pass
