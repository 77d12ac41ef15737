"""The ``disk`` backend: a persistent, crash-safe, checksummed tier shared by processes.

* One object file per chunk (the lmcache-core object format, data at a 4 KiB offset) at
  ``<path>/ns-<namespace digest>/<key.to_path()>``; directories 0700, files 0600 by default.
* A put reserves space in the shared index (evicting least recently used entries of any
  process), writes a temporary file in the target directory, flushes it, renames it over
  the object and records it - rename and record in one index transaction - then fsyncs the
  directory. A process killed at any instant leaves the old object, the new one, or none.
* A get verifies size, header, identity and checksum; a bad object is a miss, and is
  removed and counted.
* All file and index work runs in a pool of ``concurrency`` threads (measured faster than
  aiofiles, see ``docs/backends/disk.md``); the event loop only schedules.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import itertools
import json
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from lmcache_core.backend import BaseBackend, Capabilities
from lmcache_core.errors import ConfigError
from lmcache_core.keys import CacheEngineKey, Namespace
from lmcache_core.options import build_options

from . import layout
from .aligned import BufferPool, probe_direct_io
from .index import IndexTx, SharedIndex
from .maint import DiskMaintenance
from .objects import HeaderTemplate, ObjectIO, ReadOutcome, ReadResult
from .options import DiskOptions, dir_mode, parse_mode
from .owners import OwnerLock, claim_dead_owner, list_owner_ids, new_owner_id

__all__ = ["DiskBackend"]

log = logging.getLogger("lmcache_core.disk")
T = TypeVar("T")

#: Idle O_DIRECT staging buffers kept for reuse, per backend.
STAGING_POOL_BYTES = 1 << 30
_EVICT_BATCH = 64


@dataclass
class _Write:
    """One object to store: its reservation and progress."""

    template: HeaderTemplate  # its header, checksum digits left open
    rel: str
    tmp: str
    size: int
    value: torch.Tensor
    pending_id: int | None = None
    written: bool = False
    new_dirs: tuple[str, ...] = ()  # parents of directories created for it (to fsync)


class _Counters:
    """Backend-specific counters (reported by ``stats()``)."""

    def __init__(self) -> None:
        self.bad_objects = 0  # truncated / corrupted / foreign objects met on read
        self.bad_removed = 0
        self.busy_misses = 0  # read while being evicted
        self.evictions = 0
        self.evicted_bytes = 0
        self.store_failures = 0  # I/O errors while storing (ENOSPC, EIO, ...)
        self.full_rejections = 0  # no room even after evicting everything evictable
        self.index_errors = 0
        self.read_errors = 0
        self.reaped_owners = 0
        self.removed_temps = 0


class DiskBackend(DiskMaintenance, BaseBackend):
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
        self.counters = _Counters()

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
        if res.outcome is ReadOutcome.BUSY:
            self.counters.busy_misses += 1
        elif res.outcome is ReadOutcome.BAD:
            self.counters.bad_objects += 1
            log.warning(
                "disk tier %s: %s is unusable (%s); removing it", self.root, rel, res.reason
            )
            self._remove_bad_sync(rel, res.inode)
        return False

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

    # ================================================================== writes
    def _plan(self, key: CacheEngineKey, value: torch.Tensor) -> _Write:
        rel = self._rel(key)
        tmp = layout.temp_relpath(rel, self.owner, next(self._seq))
        template = HeaderTemplate(key.to_string(), self._ns_json, value.dtype, tuple(value.shape))
        size = len(template) + value.numel() * value.element_size()
        return _Write(template, rel, tmp, size, value)

    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        return (await self._call(self._put_sync, [self._plan(key, value)]))[0]

    async def _batched_put(
        self, keys: Sequence[CacheEngineKey], values: Sequence[torch.Tensor], donate: bool
    ) -> list[bool]:
        last: dict[CacheEngineKey, int] = {}
        for i, k in enumerate(keys):
            last[k] = i  # a later duplicate wins: only the last value is written
        order = sorted(last.values())
        writes = [self._plan(keys[i], values[i]) for i in order]
        slot = {i: j for j, i in enumerate(order)}
        if len(writes) <= 1:
            results = await self._call(self._put_sync, writes)
        else:
            done: concurrent.futures.Future[list[bool]] = concurrent.futures.Future()
            self._submit_or_run(self._put_batch, writes, done)
            results = (await self._await_all([done]))[0]
        return [results[slot[last[k]]] for k in keys]

    def _put_batch(self, writes: list[_Write], done: concurrent.futures.Future[list[bool]]) -> None:
        """Reserve room for a batch, then fan its writes out to the pool; the write that
        finishes last publishes the batch and resolves ``done``. Runs in a pool thread, so
        no step waits for the event loop."""
        try:
            self._reserve_sync(writes)
        except BaseException:
            self._finish_batch(writes, done)
            raise
        todo = [w for w in writes if w.pending_id is not None]
        if not todo:
            self._finish_batch(writes, done)
            return
        left = [len(todo)]
        lock = threading.Lock()

        def write_one(w: _Write) -> None:
            try:
                self._write_sync(w)
            finally:
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    self._finish_batch(writes, done)

        for w in todo:
            self._submit_or_run(write_one, w)

    def _finish_batch(
        self, writes: list[_Write], done: concurrent.futures.Future[list[bool]]
    ) -> None:
        try:
            done.set_result(self._publish_sync(writes))
        except BaseException as exc:
            done.set_exception(exc)

    def _put_sync(self, writes: list[_Write]) -> list[bool]:
        self._reserve_sync(writes)
        try:
            for w in writes:
                if w.pending_id is not None:
                    self._write_sync(w)
        finally:
            results = self._publish_sync(writes)
        return results

    def _ensure_namespace_dir(self) -> None:
        """Create this namespace's directory and its ``namespace.json`` marker (once)."""
        if self._ns_ready:
            return
        with self._ns_lock:
            if self._ns_ready:
                return
            ns_path = self._abs(self._ns_dir)
            layout.make_dirs(ns_path, self.dir_mode, durable=self.opts.fsync)
            marker = os.path.join(ns_path, layout.NAMESPACE_FILE)
            if not os.path.exists(marker):
                tmp = f"{marker}.{self.owner}.tmp"
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                fd = os.open(tmp, flags, self.file_mode)
                try:
                    os.write(fd, json.dumps({"namespace": self._ns_json}).encode("utf-8"))
                    os.fchmod(fd, self.file_mode)
                finally:
                    os.close(fd)
                os.replace(tmp, marker)
            self._ns_ready = True

    def _reserve_sync(self, writes: list[_Write]) -> None:
        """Reserve space for each write (evicting as needed); unreserved writes are refused."""
        try:
            self._ensure_namespace_dir()
            self._reserve_once(writes)
            # Room may be held by writers that died: settle them and try once more.
            if any(w.pending_id is None and w.size <= self.max_bytes for w in writes) and (
                self._reap_sync()
            ):
                self._reserve_once([w for w in writes if w.pending_id is None])
        except (OSError, sqlite3.Error) as exc:
            self.counters.index_errors += 1
            self._stats.errors += 1
            log.warning("disk tier %s: reserving space failed: %s", self.root, exc)
            for w in writes:
                w.pending_id = None  # the transaction rolled back
            return
        self.counters.full_rejections += sum(w.pending_id is None for w in writes)

    def _reserve_once(self, writes: list[_Write]) -> None:
        now = time.time()
        touches = self._take_touches()
        granted: list[tuple[_Write, int]] = []
        with self.index.transaction() as tx:
            tx.touch(touches)
            if not self._bound_recorded:  # for inspect: the bound writers enforce
                tx.set_meta("max_bytes", str(self.max_bytes))
            for w in writes:
                if (
                    w.pending_id is None
                    and w.size <= self.max_bytes
                    and self._make_room(tx, w.size)
                ):
                    granted.append((w, tx.add_pending(self.owner, w.rel, w.tmp, w.size, now)))
            totals = tx.totals()
        # Only once committed: a failed commit must leave no write believing it holds room.
        for w, pending_id in granted:
            w.pending_id = pending_id
        self._totals = totals
        self._bound_recorded = True

    def _make_room(self, tx: IndexTx, size: int) -> bool:
        """Evict least recently used entries until ``size`` more bytes fit."""
        skipped = 0
        while tx.used() + size > self.max_bytes:
            batch = tx.lru(_EVICT_BATCH, skipped)
            if not batch:
                return False
            for rel, esize in batch:
                if self._evict_file(rel):
                    tx.delete_entry(rel)
                    self.counters.evictions += 1
                    self.counters.evicted_bytes += esize
                    if tx.used() + size <= self.max_bytes:
                        return True
                else:
                    skipped += 1
        return True

    def _evict_file(self, rel: str) -> bool:
        """Unlink an object unless someone is reading it; ``True`` when it is gone."""
        if not layout.is_object_relpath(rel):
            return True  # never touch anything outside the object tree: just drop the row
        path = self._abs(rel)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
        return True

    def _write_sync(self, w: _Write) -> None:
        try:
            value = w.value
            if value.device.type != "cpu":
                value = value.to("cpu")
            _, new_dirs = self.io.write_temp(self._abs(w.tmp), w.template, value.contiguous())
            w.new_dirs = tuple(new_dirs)
            w.written = True
        except OSError as exc:
            self.counters.store_failures += 1
            self._stats.errors += 1
            log.warning("disk tier %s: writing %s failed: %s", self.root, w.rel, exc)

    def _publish_sync(self, writes: list[_Write]) -> list[bool]:
        """Rename written objects into place and record them; release all reservations."""
        results = [False] * len(writes)
        renamed: list[int] = []
        now = time.time()
        try:
            with self.index.transaction() as tx:
                for i, w in enumerate(writes):
                    if w.pending_id is None:
                        continue
                    if w.written:
                        try:
                            os.rename(self._abs(w.tmp), self._abs(w.rel))
                        except OSError as exc:
                            self.counters.store_failures += 1
                            log.warning(
                                "disk tier %s: publishing %s failed: %s", self.root, w.rel, exc
                            )
                            _unlink_quiet(self._abs(w.tmp))
                        else:
                            renamed.append(i)
                            tx.upsert_entry(w.rel, w.size, now)
                    tx.delete_pending(w.pending_id)
                self._totals = tx.totals()
        except sqlite3.Error as exc:
            # Not recorded: take the renamed files back (their reservations stay counted
            # until this owner is gone - an over-count, never an overshoot).
            self.counters.index_errors += 1
            log.warning("disk tier %s: recording stores failed: %s", self.root, exc)
            for j, w in enumerate(writes):
                if j in renamed:
                    _unlink_quiet(self._abs(w.rel))
                elif w.pending_id is not None:
                    _unlink_quiet(self._abs(w.tmp))
            self._release_pending_quietly(writes)
            return results
        for i in renamed:
            results[i] = True
        if self.opts.fsync and renamed:
            # One fsync per directory touched by the batch (the renames, and the entries of
            # directories created for it), deepest first; on journaling filesystems the
            # first one commits them all and the rest return at once.
            dirs = {os.path.dirname(self._abs(writes[i].rel)) for i in renamed}
            dirs.update(d for i in renamed for d in writes[i].new_dirs)
            for d in sorted(dirs, key=lambda p: (-p.count(os.sep), p)):
                try:
                    layout.fsync_dir(d)
                except OSError as exc:
                    log.warning("disk tier %s: fsync of %s failed: %s", self.root, d, exc)
        return results

    def _release_pending_quietly(self, writes: list[_Write]) -> None:
        try:
            with self.index.transaction() as tx:
                for w in writes:
                    if w.pending_id is not None:
                        tx.delete_pending(w.pending_id)
                self._totals = tx.totals()
        except sqlite3.Error:
            pass

    # ================================================================== removal
    async def _remove(self, key: CacheEngineKey) -> bool:
        return await self._call(self._remove_rel_sync, self._rel(key))

    def _remove_rel_sync(self, rel: str) -> bool:
        if not layout.is_object_relpath(rel):
            raise ValueError(f"{rel!r} is not an object location of a disk tier")
        path = self._abs(rel)
        try:
            with self.index.transaction() as tx:
                removed = _unlink_quiet(path)
                tx.delete_entry(rel)
                self._totals = tx.totals()
        except sqlite3.Error as exc:
            self.counters.index_errors += 1
            log.warning(
                "disk tier %s: index update for removing %s failed: %s", self.root, rel, exc
            )
            return _unlink_quiet(path)
        return removed

    # ================================================================== recovery
    def _reap_sync(self) -> int:
        """Settle the leftovers of dead owners: remove their temporary files, adopt objects
        they renamed but did not record, drop their reservations. Returns owners reaped."""
        owners = set(list_owner_ids(self.root))
        with self.index.snapshot() as tx:
            owners.update(tx.pending_owners())
        owners.discard(self.owner)
        reaped = 0
        for owner in sorted(owners):
            dead = claim_dead_owner(self.root, owner)
            if dead is None:
                continue
            try:
                with self.index.transaction() as tx:
                    for pending_id, rel, tmp, _size in tx.pending_of(owner):
                        if layout.is_temp_relpath_of(rel, tmp):
                            if _unlink_quiet(self._abs(tmp)):
                                self.counters.removed_temps += 1
                            try:
                                st = os.lstat(self._abs(rel))
                            except FileNotFoundError:
                                pass
                            else:
                                if tx.entry_size(rel) != st.st_size:
                                    tx.upsert_entry(rel, st.st_size, time.time())
                        tx.delete_pending(pending_id)
                    self._totals = tx.totals()
            finally:
                dead.done()
            reaped += 1
        self.counters.reaped_owners += reaped
        return reaped

    def _rebuild_sync(self) -> None:
        """Rebuild the index from the files (a new, lost or damaged index)."""
        t0 = time.monotonic()
        n = 0
        stale_before = time.time() - self.opts.stale_temp_seconds
        with self.index.transaction() as tx:
            live_tmps = tx.pending_tmp_names()
            tx.clear_entries()
            for ns in layout.namespace_dirs(self.root):
                for f in layout.iter_files(self.root, ns):
                    if isinstance(f, layout.ObjectFile):
                        tx.upsert_entry(f.rel, f.size, f.mtime)
                        n += 1
                    elif (
                        f.rel not in live_tmps
                        and self._temp_is_stale(f, stale_before)
                        and (_unlink_quiet(self._abs(f.rel)))
                    ):
                        self.counters.removed_temps += 1
            tx.set_meta("complete", "1")
        if n:
            log.info(
                "disk tier %s: index rebuilt from %d objects in %.1f s",
                self.root,
                n,
                time.monotonic() - t0,
            )

    def _temp_is_stale(self, f: layout.TempFile, stale_before: float) -> bool:
        if f.owner == self.owner:
            return False
        if f.mtime < stale_before:
            return True
        dead = claim_dead_owner(self.root, f.owner)
        if dead is None:
            return False
        dead.done()
        return True

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
            "busy_misses": c.busy_misses,
            "store_failures": c.store_failures,
            "full_rejections": c.full_rejections,
            "index_errors": c.index_errors,
            "read_errors": c.read_errors,
            "reaped_owners": c.reaped_owners,
            "removed_temps": c.removed_temps,
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


def _unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
