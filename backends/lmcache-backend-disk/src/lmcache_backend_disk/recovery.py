"""Recovery of a disk tier: settle what dead writers left, rebuild a lost or damaged index.

The index heals itself:

* at start, under ``index.lock``, an index that is missing, incomplete, fails
  ``quick_check`` or its schema audit is moved aside and rebuilt from the files;
* at run time, any transaction that meets a damaged index (a SQLite corruption error, a
  foreign schema) or finds that the index file was replaced or deleted under it reports it
  (``SharedIndex.on_damage``); the backend then stops using the index (puts fail softly,
  reads go on: they need no index), and a background thread takes ``index.lock``, moves
  the damaged file aside if it is still in place (another process may have rebuilt it
  already: then that index is simply opened), and rebuilds from the files.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from . import layout
from .owners import OwnerLock, claim_dead_owner, list_owner_ids
from .state import DiskState

__all__ = ["DiskRecovery"]

log = logging.getLogger("lmcache_core.disk")

INDEX_LOCK_REL = f"{layout.META_DIR}/{layout.INDEX_LOCK}"
#: Seconds before a failed rebuild is tried again.
HEAL_RETRY_S = 5.0


class DiskRecovery(DiskState):
    """Dead-owner clean-up, index rebuild and healing (a mixin)."""

    _heal_lock: threading.Lock
    _heal_thread: threading.Thread | None
    _heal_timer: threading.Timer | None
    _closing: bool
    _owner_lock: OwnerLock | None

    if TYPE_CHECKING:

        def _make_meta_dirs(self) -> list[str]: ...

    # ------------------------------------------------------------------ dead owners
    def _reap_sync(self) -> int:
        """Settle the leftovers of dead owners: remove their temporary files, adopt objects
        they renamed but did not record, drop their reservations and pins. Returns owners
        reaped. Owner ids come from file names and index rows, checked against their
        fixed format; paths from index rows are checked against the layout's shapes."""
        owners = set(list_owner_ids(self.tier))
        with self.index.snapshot() as tx:
            owners.update(tx.pending_owners())
            owners.update(tx.pin_owners())
        owners.discard(self.owner)
        reaped = 0
        for owner in sorted(owners):
            dead = claim_dead_owner(self.tier, owner)
            if dead is None:
                continue
            try:
                with self.index.transaction() as tx:
                    for pending_id, rel, tmp, _size in tx.pending_of(owner):
                        if self.tier.unlink(tmp):
                            self.counters.removed_temps += 1
                        st = self.tier.lstat(rel)
                        if (
                            st is not None
                            and stat.S_ISREG(st.st_mode)
                            and tx.entry_size(rel) != st.st_size
                        ):
                            tx.upsert_entry(rel, st.st_size, time.time())
                        tx.delete_pending(pending_id)
                    tx.delete_pins_of(owner)
                    self._totals = tx.totals()
            finally:
                dead.done()
            reaped += 1
        self.counters.reaped_owners += reaped
        return reaped

    # ------------------------------------------------------------------ rebuild
    def _rebuild_sync(self) -> None:
        """Rebuild the index from the files (a new, lost or damaged index)."""
        t0 = time.monotonic()
        n = 0
        stale_before = time.time() - self.opts.stale_temp_seconds
        with self.index.transaction() as tx:
            live_tmps = tx.pending_tmp_names()
            tx.clear_entries()
            for ns in layout.namespace_dirs(self.tier):
                for f in layout.iter_files(self.tier, ns):
                    if isinstance(f, layout.ObjectFile):
                        tx.upsert_entry(f.rel, f.size, f.mtime)
                        n += 1
                    elif (
                        f.rel not in live_tmps
                        and self._temp_is_stale(f, stale_before)
                        and self.tier.unlink(f.rel)
                    ):
                        self.counters.removed_temps += 1
            tx.recompute_totals()
            tx.set_meta("complete", "1")
        self.counters.index_rebuilds += 1
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
        dead = claim_dead_owner(self.tier, f.owner)
        if dead is None:
            return False
        dead.done()
        return True

    # ------------------------------------------------------------------ index.lock
    @contextmanager
    def _index_lock(self) -> Iterator[None]:
        """Hold ``index.lock`` (serialises index creation, rebuilds and healing)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK
        try:
            fd = self.tier.open(INDEX_LOCK_REL, flags, self.file_mode)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            self.tier.unlink(INDEX_LOCK_REL)  # a planted link: removed, never followed
            fd = self.tier.open(INDEX_LOCK_REL, flags, self.file_mode)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, "index.lock is not a regular file", INDEX_LOCK_REL)
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != self.file_mode:
                os.fchmod(fd, self.file_mode)  # whatever the umask: group sharing needs it
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _open_index_locked(self, previous: tuple[int, int] | None = None) -> None:
        """Open the index (under ``index.lock``) and rebuild it from the files unless it is
        complete and sound.

        When healing, ``previous`` is the index file this backend used: if it is still in
        place it is the damaged one and is moved aside; if another file is there (someone
        deleted or replaced it, or another process already rebuilt it), that one is opened
        and brought in line with the files (objects it lacks adopted, rows without a file
        dropped), since it may be older than the files."""
        index = self.index
        current = index.current_ident()
        replaced = previous is not None and current is not None and current != previous
        if previous is not None and current == previous:
            index.move_aside()
        if not index.open():
            self._rebuild_sync()
        elif replaced:
            self._sync_rows_with_files()

    def _sync_rows_with_files(self) -> tuple[int, int]:
        """Adopt object files the index lacks, drop rows whose file is gone, recompute the
        totals; ``(adopted, dropped)``."""
        with self.index.snapshot() as tx:
            rows = tx.entries()
        found: dict[str, tuple[int, float]] = {}
        for ns in layout.namespace_dirs(self.tier):
            for f in layout.iter_files(self.tier, ns):
                if isinstance(f, layout.ObjectFile):
                    found[f.rel] = (f.size, f.mtime)
        adopted = dropped = 0
        with self.index.transaction() as tx:
            for rel, (size, mtime) in found.items():
                if rel not in rows and tx.entry_size(rel) is None:
                    tx.upsert_entry(rel, size, mtime)
                    adopted += 1
            for rel in rows:
                if rel not in found and self.tier.lstat(rel) is None:
                    dropped += int(tx.delete_entry(rel))
            tx.recompute_totals()
            self._totals = tx.totals()
        return adopted, dropped

    # ------------------------------------------------------------------ healing
    def _index_damaged(self, exc: BaseException) -> None:
        """``SharedIndex.on_damage``: stop using the index and rebuild it in the background."""
        with self._heal_lock:
            if self._heal_thread is not None or self._closing:
                return
            damaged = self.index.ident
            log.warning("disk tier %s: index damaged (%s); rebuilding it", self.root, exc)
            self.index.refuse(f"the index is being rebuilt ({exc})")
            thread = threading.Thread(
                target=self._heal, args=(damaged,), name=f"lmcache-{self.owner}-heal", daemon=True
            )
            self._heal_thread = thread
        self.counters.index_heals += 1
        thread.start()

    def _heal(self, damaged: tuple[int, int] | None) -> None:
        index = self.index
        try:
            index.refuse(index.unavailable or "the index is being rebuilt", threading.get_ident())
            self._restore_meta_sync()
            with self._index_lock():
                index.close()
                if self._closing:
                    return
                self._open_index_locked(damaged)
            with index.snapshot() as tx:
                self._totals = tx.totals()
        except Exception as exc:  # retried: a full disk, say, may clear up
            log.error("disk tier %s: rebuilding the index failed: %s", self.root, exc)
            index.refuse(f"rebuilding the index failed ({exc}); retrying")
            with self._heal_lock:
                self._heal_thread = None
                if not self._closing:
                    timer = threading.Timer(HEAL_RETRY_S, self._index_damaged, (exc,))
                    timer.daemon = True
                    self._heal_timer = timer
                    timer.start()
            return
        with self._heal_lock:
            self._heal_thread = None
            if not self._closing:
                index.accept()
        log.info("disk tier %s: index healed", self.root)

    def _restore_meta_sync(self) -> None:
        """Recreate ``.lmcache-disk/owners`` (links or files in their place are removed) and
        this backend's owner file if it went missing or was replaced."""
        self._make_meta_dirs()
        self._ensure_owner_file()

    def _ensure_owner_file(self) -> None:
        """Put this backend's owner file back if it was deleted or replaced (others would
        otherwise take this live backend for dead and settle its writes in progress)."""
        lock = self._owner_lock
        if lock is None or lock.in_place():
            return
        log.warning(
            "disk tier %s: the owner file of this backend was removed; restoring it", self.root
        )
        self._owner_lock = OwnerLock(self.tier, self.owner, self.file_mode)
        lock.drop()

    def _wait_healed(self, timeout: float | None = None) -> bool:
        """Wait for a rebuild in progress; ``True`` when the index is usable."""
        thread = self._heal_thread
        if thread is not None:
            thread.join(timeout)
        return self.index.unavailable is None

    def _stop_healing(self) -> None:
        """At close: no new rebuild; wait for one in progress."""
        with self._heal_lock:
            self._closing = True
            if self._heal_timer is not None:
                self._heal_timer.cancel()
                self._heal_timer = None
            thread = self._heal_thread
        if thread is not None:
            thread.join()
