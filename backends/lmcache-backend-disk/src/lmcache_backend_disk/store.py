"""The disk backend's write path: reserve, write, publish.

A put reserves room in the shared index (evicting least recently used entries of any
process, never one being read), writes a temporary file next to the object, then - in one
index transaction - renames it over the object and records it, and finally flushes the
files and fsyncs the directories involved, all at once, before it returns. A batch
reserves once, fans its writes out to the I/O pool from a pool thread, and the write that
finishes last publishes the batch, so no step waits for the event loop.

The flushes come after the renames, in one wave with the directory fsyncs, so a put waits
for one journal commit instead of two in a row (the files' and then the directories').
The renamed object is complete in the file system when it is renamed (its writes have
returned), so no process ever sees a partial one. Only power loss during the wave can
leave an object whose data did not reach the device under its final name, and no read
serves it: every read verifies the size, the header and the checksum of the data, and an
object that fails is a miss and is removed. (For ``O_DIRECT`` writes on ext4 a rename
becomes durable only in a journal commit, whose device cache flush also covers the data
written before the rename.)
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import json
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_core.codecs import envelope_codec
from lmcache_core.cuda_sync import host_copy, ready_event
from lmcache_core.keys import CacheEngineKey

from . import layout, sandbox
from .index import IndexTx, IndexUnavailable
from .objects import HeaderTemplate
from .state import DiskState

__all__ = ["DiskStore"]

log = logging.getLogger("lmcache_core.disk")
_EVICT_BATCH = 64
#: Seconds between audits of the shared totals against the rows (by a reserving writer).
AUDIT_INTERVAL_S = 60.0
#: Shortest time between two audits started because the totals exceed the bound.
AUDIT_OVER_BOUND_S = 5.0
#: Reservations between prunings of the index's change log (see ``IndexTx.prune_changes``).
PRUNE_EVERY = 256
#: Seconds between checks that this backend's owner file is still in place.
OWNER_CHECK_S = 10.0


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
    fd: int | None = None  # the open temporary file, written but not flushed yet
    ready: Any = None  # a CUDA value: its event on the caller's stream (lmcache_core.cuda_sync)


class DiskStore(DiskState):
    """Puts of the disk backend (a mixin)."""

    _reservations = 0

    def _plan(self, key: CacheEngineKey, value: torch.Tensor) -> _Write:
        rel = self._rel(key)
        tmp = layout.temp_relpath(rel, self.owner, next(self._seq))
        template = HeaderTemplate(
            key.to_string(), self._ns_json, value.dtype, tuple(value.shape), envelope_codec(value)
        )
        size = len(template) + value.numel() * value.element_size()
        return _Write(template, rel, tmp, size, value, ready=ready_event(value))

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
            tier = self.tier
            new_dirs = tier.make_dirs(self._ns_dir, self.dir_mode, self.io.umask)
            marker = f"{self._ns_dir}/{layout.NAMESPACE_FILE}"
            st = tier.lstat(marker)
            if st is None or not stat.S_ISREG(st.st_mode):
                data = json.dumps({"namespace": self._ns_json}).encode("utf-8")
                tier.write_file(marker, data, self.file_mode, self.io.umask)
                new_dirs.append(self._ns_dir)
            if self.opts.fsync:
                for d in new_dirs:
                    tier.fsync_dir(d)
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
        except IndexUnavailable:
            self.counters.index_unavailable += len(writes)  # being rebuilt: refused softly
            for w in writes:
                w.pending_id = None
            return
        except (OSError, sqlite3.Error) as exc:
            self.counters.index_errors += 1
            self._stats.errors += 1
            log.warning("disk tier %s: reserving space failed: %s", self.root, exc)
            for w in writes:
                w.pending_id = None  # the transaction rolled back
            return
        self.counters.full_rejections += sum(w.pending_id is None for w in writes)

    def _reserve_once(self, writes: list[_Write]) -> None:
        if time.monotonic() - self._last_owner_check >= OWNER_CHECK_S:
            self._last_owner_check = time.monotonic()
            self._ensure_owner_file()
        now = time.time()
        touches = self._take_touches()
        unpins = self._take_unpins()
        granted: list[tuple[_Write, int]] = []
        try:
            with self.index.transaction() as tx:
                tx.touch(touches)
                if unpins:
                    tx.delete_pins(unpins)
                if not self._bound_recorded:  # for inspect: the bound writers enforce
                    tx.set_meta("max_bytes", str(self.max_bytes))
                self._reservations += 1
                if self._reservations % PRUNE_EVERY == 0:
                    tx.prune_changes()
                if time.monotonic() - self._last_audit >= AUDIT_INTERVAL_S:
                    self._last_audit = time.monotonic()
                    if tx.audit():
                        log.warning("disk tier %s: index totals were wrong; fixed", self.root)
                for w in writes:
                    if (
                        w.pending_id is None
                        and w.size <= self.max_bytes
                        and self._make_room(tx, w.size)
                    ):
                        pending_id = tx.add_pending(self.owner, w.rel, w.tmp, w.size, now)
                        granted.append((w, pending_id))
                totals = tx.totals()
        except BaseException:
            self._requeue_unpins(unpins)
            raise
        # Only once committed: a failed commit must leave no write believing it holds room.
        for w, pending_id in granted:
            w.pending_id = pending_id
        self._totals = totals
        self._bound_recorded = True

    def _make_room(self, tx: IndexTx, size: int) -> bool:
        """Evict least recently used entries until ``size`` more bytes fit (pinned entries
        and entries being read are skipped)."""
        skipped = 0
        now = time.time()
        audited = False
        if tx.used() > self.max_bytes and time.monotonic() - self._last_audit > AUDIT_OVER_BOUND_S:
            # over the bound before this write: falsified totals would make it evict
            # everything, so check them first (rate-limited)
            self._last_audit = time.monotonic()
            audited = True
            if tx.audit():
                log.warning("disk tier %s: index totals were wrong; fixed", self.root)
        while tx.used() + size > self.max_bytes:
            batch = tx.lru(_EVICT_BATCH, skipped, now)
            if not batch:
                # Nothing left to evict: unless the totals are wrong (checked once), full.
                if audited or not tx.audit():
                    return False
                audited = True
                log.warning("disk tier %s: index totals were wrong; fixed", self.root)
                continue
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
        """Unlink an object unless someone is reading it; ``True`` when it is gone (or was
        never reachable: a link on the way is removed, never followed)."""
        if not layout.is_object_relpath(rel):
            return True  # never touch anything outside the object tree: just drop the row
        tier = self.tier
        try:
            fd = tier.open(rel, os.O_RDONLY | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return True
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            tier.remove_links(rel)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            tier.unlink(rel)
        except IsADirectoryError:
            log.warning("disk tier %s: a directory sits at %s; dropping its row", self.root, rel)
        finally:
            os.close(fd)
        return True

    def _write_sync(self, w: _Write) -> None:
        try:
            value = w.value
            if value.device.type != "cpu":  # after the caller's queued work that makes it
                value = host_copy(w.ready, value)
            # flushed after the renames, with its batch (_sync_published)
            _, new_dirs, w.fd = self.io.write_temp_unsynced(w.tmp, w.template, value.contiguous())
            w.new_dirs = tuple(new_dirs)
            w.written = True
        except (OSError, RuntimeError) as exc:  # (RuntimeError: a device value's copy)
            self.counters.store_failures += 1
            self._stats.errors += 1
            log.warning("disk tier %s: writing %s failed: %s", self.root, w.rel, exc)

    def _publish_sync(self, writes: list[_Write]) -> list[bool]:
        """Rename written objects into place and record them, release all reservations,
        then flush what was published (:meth:`_sync_published`)."""
        results = [False] * len(writes)
        if all(w.pending_id is None for w in writes):
            return results  # nothing was reserved: nothing written, published or released
        renamed: list[int] = []
        now = time.time()
        try:
            with self.index.transaction() as tx:
                for i, w in enumerate(writes):
                    if w.pending_id is None:
                        continue
                    if w.written:
                        try:
                            head, _, name = w.rel.rpartition("/")
                            self.tier.rename(head, w.tmp.rpartition("/")[2], name)
                        except OSError as exc:
                            self.counters.store_failures += 1
                            log.warning(
                                "disk tier %s: publishing %s failed: %s", self.root, w.rel, exc
                            )
                            self._close_quietly(w)
                            self._unlink_quietly(w.tmp)
                        else:
                            renamed.append(i)
                            tx.upsert_entry(w.rel, w.size, now)
                    tx.delete_pending(w.pending_id)
                self._totals = tx.totals()
        except BaseException as exc:
            # Not recorded: take the renamed files back (their reservations stay counted
            # until this owner is gone - an over-count, never an overshoot).
            for w in writes:
                self._close_quietly(w)
            if not isinstance(exc, sqlite3.Error):
                raise
            self.counters.index_errors += 1
            log.warning("disk tier %s: recording stores failed: %s", self.root, exc)
            for j, w in enumerate(writes):
                if j in renamed:
                    self._unlink_quietly(w.rel)
                elif w.pending_id is not None:
                    self._unlink_quietly(w.tmp)
            self._release_pending_quietly(writes)
            return results
        failed = {id(w) for w in self._sync_published([writes[i] for i in renamed])}
        for i in renamed:
            results[i] = id(writes[i]) not in failed
        return results

    def _sync_published(self, published: list[_Write]) -> list[_Write]:
        """Flush and close the files just renamed and fsync the directories the batch
        changed (those of the renames and the parents of directories created for it), all
        in one wave issued at once (:meth:`Flusher.sync_fds`): on journaling file systems
        they join one commit instead of waiting for one round trip each. Returns the
        writes whose file failed to flush: they are unpublished again (removed, their
        records deleted) and failed."""
        files = [w for w in published if w.fd is not None]
        file_fds = [w.fd for w in files if w.fd is not None]
        for w in files:
            w.fd = None
        dirs: list[str] = []
        dir_fds: list[int] = []
        if self.opts.fsync:
            touched = {w.rel.rpartition("/")[0] for w in published}
            touched.update(d for w in published for d in w.new_dirs)
            for d in sorted(touched, key=lambda p: (-p.count("/"), p)):
                try:
                    dir_fds.append(self.tier.open_dir(d))
                    dirs.append(d)
                except OSError as exc:
                    log.warning("disk tier %s: fsync of %s failed: %s", self.root, d, exc)
        inodes: list[int | None] = []
        for fd in file_fds:
            try:
                inodes.append(os.fstat(fd).st_ino)
            except OSError:
                inodes.append(None)
        try:
            if self.io.durable:
                errors = self._flusher.sync_fds(
                    file_fds + dir_fds, [True] * len(file_fds) + [False] * len(dir_fds)
                )
            else:
                errors = [None] * (len(file_fds) + len(dir_fds))
        finally:
            for fd in file_fds + dir_fds:
                os.close(fd)
        failed: list[tuple[_Write, int | None]] = []
        for w, ino, err in zip(files, inodes, errors[: len(files)], strict=True):
            if err is not None:
                failed.append((w, ino))
                self.counters.store_failures += 1
                self._stats.errors += 1
                log.warning("disk tier %s: flushing %s failed: %s", self.root, w.rel, err)
        for d, err in zip(dirs, errors[len(files) :], strict=True):
            if err is not None and err.errno not in sandbox.DIR_FSYNC_REFUSED:
                log.warning("disk tier %s: fsync of %s failed: %s", self.root, d, err)
        if failed:
            self._unpublish(failed)
        return [w for w, _ in failed]

    def _unpublish(self, failed: list[tuple[_Write, int | None]]) -> None:
        """Remove objects published by this batch whose flush failed, and their records;
        an object another writer has put in the place since (another inode) is left."""
        gone: list[str] = []
        for w, ino in failed:
            st = self.tier.lstat(w.rel)
            if st is not None and (ino is None or st.st_ino == ino):
                self._unlink_quietly(w.rel)
                gone.append(w.rel)
        if not gone:
            return
        try:
            with self.index.transaction() as tx:
                for rel in gone:
                    tx.delete_entry(rel)
                self._totals = tx.totals()
        except sqlite3.Error as exc:  # a row without its file: a miss, settled on read
            self.counters.index_errors += 1
            log.warning("disk tier %s: dropping failed stores failed: %s", self.root, exc)

    def _close_quietly(self, w: _Write) -> None:
        fd, w.fd = w.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _unlink_quietly(self, rel: str) -> None:
        try:
            self.tier.unlink(rel)
        except OSError as exc:
            log.warning("disk tier %s: could not remove %s: %s", self.root, rel, exc)

    def _release_pending_quietly(self, writes: list[_Write]) -> None:
        try:
            with self.index.transaction() as tx:
                for w in writes:
                    if w.pending_id is not None:
                        tx.delete_pending(w.pending_id)
                self._totals = tx.totals()
        except sqlite3.Error:
            pass
