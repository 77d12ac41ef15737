"""The shared index's file and connection: opened safely, used by every thread.

SQLite opens ``index.sqlite`` (and its ``-wal``/``-shm``) by name, so the files are checked
through the tier's :class:`~.sandbox.TierDir` before and after SQLite opens them: plain
files with one hard link, reached without any symbolic link, the very ones the checked
name leads to; ``-wal`` and ``-shm`` are created here with the tier's mode, so SQLite
never creates them. ``PRAGMA quick_check`` and the schema and totals audits
(:class:`~.index.IndexTx`) run when an existing index is opened. Every transaction first
checks that the index file and its directory are still the ones opened (deleted or
replaced by someone otherwise), and a damaged, replaced or deleted index is reported to
``on_damage`` (the backend then rebuilds it, see :mod:`.recovery`).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .index import (
    SCHEMA_VERSION,
    IndexBusy,
    IndexDamaged,
    IndexTx,
    IndexUnavailable,
    is_damage,
    text_or_bytes,
)
from .layout import INDEX_FILE, META_DIR
from .sandbox import TierDir

__all__ = ["SharedIndex", "local_commits"]

log = logging.getLogger("lmcache_core.disk")

_INDEX_FILES = ("", "-wal", "-shm", "-journal")

#: Write transactions committed by this process, per tier root (``(st_dev, st_ino)``):
#: a key view (:mod:`.view`) polls the index at once when this changed, so a process's
#: own puts and removals are visible to its next lookup whichever backend made them.
_COMMITS: dict[tuple[int, int], int] = {}
_COMMITS_LOCK = threading.Lock()


def local_commits(root: tuple[int, int]) -> int:
    """How many write transactions this process has committed on the tier ``root``."""
    return _COMMITS.get(root, 0)


def _count_commit(root: tuple[int, int]) -> None:
    with _COMMITS_LOCK:
        _COMMITS[root] = _COMMITS.get(root, 0) + 1


class SharedIndex:
    """One connection to a tier's index, usable from any thread (calls are serialised).

    ``on_damage(exc)`` is called (in the failing thread) when a transaction meets a damaged
    index or finds that the index file was replaced or deleted; the exception is raised
    to the caller as usual."""

    def __init__(
        self,
        tier: TierDir,
        file_mode: int,
        busy_timeout: float = 60.0,
        on_damage: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.tier = tier
        self.rel = f"{META_DIR}/{INDEX_FILE}"
        self.path = f"{tier.path}/{self.rel}"
        self.file_mode = file_mode
        self.busy_timeout = busy_timeout
        self.on_damage = on_damage
        #: Why the index cannot be used now (set while it is rebuilt), else ``None``.
        self.unavailable: str | None = None
        self._healer: int | None = None  # the thread that may use it meanwhile
        #: ``(dev, ino)`` of the index file and of its directory, as opened.
        self.ident: tuple[int, int] | None = None
        self._meta_ident: tuple[int, int] | None = None
        self._meta_fd: int | None = None
        self.files_removed = 0  # links / odd files found in place of index files
        self._con: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        st_root = os.fstat(tier.fd)
        #: ``(st_dev, st_ino)`` of the tier's root (the key of :func:`local_commits`).
        self.root_ident = (st_root.st_dev, st_root.st_ino)
        #: A second, read-only connection for the key views (:meth:`view_snapshot`), so a
        #: lookup never waits for a write transaction of this process.
        self._view_con: sqlite3.Connection | None = None
        self._view_lock = threading.Lock()
        #: Incremented each time the index is (re)opened: a view then reloads.
        self.generation = 0

    # ------------------------------------------------------------------ opening
    def open(self) -> bool:
        """Open (creating it if needed); ``True`` when the index existed, is complete and
        passed its checks. The caller holds the tier's ``index.lock``.

        A damaged index file (or one that fails ``quick_check`` or the schema audit) is
        moved aside (``index.sqlite.corrupt``) and a new one is created; the caller then
        rebuilds it from the files."""
        existed = self._check_files()
        try:
            return self._open(check=existed) and existed
        except (sqlite3.DatabaseError, UnicodeError) as exc:
            log.warning("disk tier %s: index unusable (%s); moving it aside", self.tier.path, exc)
            self.close()
            self.move_aside()
            self._check_files()
            self._open(check=False)
            return False

    def _check_files(self) -> bool:
        """Make sure the index files are plain files reached without links: anything else
        in their place (a link, a directory, a file with other hard links) is removed.
        Returns whether a usable index file exists."""
        for suffix in _INDEX_FILES:
            rel = self.rel + suffix
            st = self.tier.lstat(rel)
            if st is None or (stat.S_ISREG(st.st_mode) and st.st_nlink == 1):
                continue
            log.warning(
                "disk tier %s: %s is not a plain file (mode %o, %d links); removing it",
                self.tier.path,
                rel,
                st.st_mode,
                st.st_nlink,
            )
            self._remove_entry(rel)
        st = self.tier.lstat(self.rel)
        return st is not None and st.st_size > 0

    def _remove_entry(self, rel: str) -> None:
        try:
            self.tier.unlink(rel)
        except (IsADirectoryError, PermissionError):  # a directory: move it out of the way
            head, _, name = rel.rpartition("/")
            self.tier.rename(head, name, f".{name}.removed-{secrets.token_hex(4)}")
        self.files_removed += 1

    def _create_file(self, rel: str) -> tuple[int, int]:
        """Open (creating) the plain file ``rel`` with the tier's mode; its ``(dev, ino)``."""
        fd = self.tier.open(rel, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, self.file_mode)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise IndexDamaged(f"{rel} is not a plain file")
            if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != self.file_mode:
                os.fchmod(fd, self.file_mode)  # whatever the umask: group sharing needs it
            return st.st_dev, st.st_ino
        finally:
            os.close(fd)

    def _verify_paths(self) -> None:
        """SQLite opens files by name: check that the name leads to what was checked."""
        assert self._meta_fd is not None
        try:
            st_meta = os.stat(self.path.rpartition("/")[0])
            st_index = os.lstat(self.path)
        except OSError as exc:
            raise IndexDamaged(f"index path changed while opening: {exc}") from None
        if (st_meta.st_dev, st_meta.st_ino) != self._meta_ident or (
            st_index.st_dev,
            st_index.st_ino,
        ) != self.ident:
            raise IndexDamaged("the index file or its directory was replaced while opening")

    def _open(self, check: bool) -> bool:
        self._close_meta()
        self._meta_fd = self.tier.open_dir(META_DIR)
        st = os.fstat(self._meta_fd)
        self._meta_ident = (st.st_dev, st.st_ino)
        self.ident = self._create_file(self.rel)
        for suffix in ("-wal", "-shm"):  # created here, so SQLite never creates them
            try:
                self._create_file(self.rel + suffix)
            except FileExistsError:
                pass
        self._verify_paths()
        con = sqlite3.connect(
            self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False
        )
        con.text_factory = text_or_bytes
        try:
            con.execute("PRAGMA journal_mode=WAL").fetchone()
            con.execute("PRAGMA synchronous=NORMAL")
            con.execute("PRAGMA trusted_schema=OFF")
            self._verify_paths()
            if check:
                rows = con.execute("PRAGMA quick_check").fetchall()
                if rows != [("ok",)]:
                    raise IndexDamaged(f"quick_check: {rows[:3]}")
            con.execute("BEGIN IMMEDIATE")
            tx = IndexTx(con, writable=True, file_size=self._file_size)
            if tx.audit_schema():
                log.warning("disk tier %s: dropped foreign triggers from the index", self.tier.path)
            version = tx.meta("schema")
            if version is None:
                tx.set_meta("schema", SCHEMA_VERSION)
            elif version != SCHEMA_VERSION:
                raise IndexDamaged(f"index schema {version!r}, expected {SCHEMA_VERSION}")
            if check and tx.audit():
                log.warning("disk tier %s: index totals were wrong; recomputed", self.tier.path)
            complete = tx.meta("complete") == "1"
            con.execute("COMMIT")
        except BaseException:
            con.close()
            raise
        try:
            view_con = self._connect_view()
        except BaseException:
            con.close()
            raise
        self._con = con
        with self._view_lock:
            self._view_con = view_con
        self.generation += 1
        return complete

    def _connect_view(self) -> sqlite3.Connection:
        """The read-only connection of the key views, to the file just checked."""
        con = sqlite3.connect(
            self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False
        )
        con.text_factory = text_or_bytes
        try:
            con.execute("PRAGMA query_only=ON")
            con.execute("PRAGMA trusted_schema=OFF")
            self._verify_paths()
        except BaseException:
            con.close()
            raise
        return con

    def move_aside(self) -> None:
        """Rename the index files to ``index.sqlite.corrupt`` (+ suffixes), replacing an
        older such copy; missing ones are skipped."""
        head, _, name = self.rel.rpartition("/")
        for suffix in _INDEX_FILES:
            try:
                self.tier.rename(head, name + suffix, f"{name}.corrupt{suffix}")
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno in (errno.EISDIR, errno.ENOTEMPTY):
                    self._remove_entry(self.rel + suffix)
                else:
                    raise

    def _file_size(self, rel: str) -> int | None:
        """Size of the regular file ``rel`` (no link followed), ``None`` if there is none."""
        try:
            st = self.tier.lstat(rel)
        except OSError:
            return None
        return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None

    def current_ident(self) -> tuple[int, int] | None:
        """``(dev, ino)`` of the index file now in the directory (``None``: none there)."""
        st = self.tier.lstat(self.rel)
        return None if st is None else (st.st_dev, st.st_ino)

    def _check_identity(self) -> None:
        """Raise :class:`IndexDamaged` if the index file or its directory is no longer the
        one this connection opened (replaced or deleted by someone)."""
        meta_fd = self._meta_fd
        if meta_fd is None:
            return
        try:
            st = os.stat(INDEX_FILE, dir_fd=meta_fd, follow_symlinks=False)
            st_meta = os.stat(META_DIR, dir_fd=self.tier.fd, follow_symlinks=False)
        except FileNotFoundError:
            raise IndexDamaged("the index file was deleted") from None
        if (st.st_dev, st.st_ino) != self.ident or (
            st_meta.st_dev,
            st_meta.st_ino,
        ) != self._meta_ident:
            raise IndexDamaged("the index file was replaced")

    def _close_meta(self) -> None:
        if self._meta_fd is not None:
            os.close(self._meta_fd)
            self._meta_fd = None

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None
            with self._view_lock:
                if self._view_con is not None:
                    self._view_con.close()
                    self._view_con = None
            self._close_meta()

    # ------------------------------------------------------------------ transactions
    def refuse(self, reason: str, healer: int | None = None) -> None:
        """Refuse index work (:class:`IndexUnavailable`) from every thread but ``healer``
        (a thread id) until :meth:`accept`."""
        self._healer = healer
        self.unavailable = reason

    def accept(self) -> None:
        """Accept index work again (see :meth:`refuse`)."""
        self.unavailable = None
        self._healer = None

    def _connection(self) -> sqlite3.Connection:
        if self.unavailable is not None and threading.get_ident() != self._healer:
            raise IndexUnavailable(self.unavailable)
        con = self._con
        if con is None:
            raise IndexUnavailable("index is closed")
        return con

    def _damaged(self, exc: BaseException) -> None:
        if self.on_damage is not None and is_damage(exc):
            self.on_damage(exc)

    @contextmanager
    def transaction(self, wait: float | None = None) -> Iterator[IndexTx]:
        """A write transaction (``BEGIN IMMEDIATE``): committed on success, rolled back on
        error. Holds the index's write lock against every process until it ends.

        ``wait`` bounds the time spent waiting for the lock (this process's other threads
        and other processes): past it :class:`IndexBusy` is raised and nothing is done.
        """
        if wait is None:
            self._lock.acquire()
        elif not self._lock.acquire(timeout=wait):
            raise IndexBusy("the index is in use by another thread")
        try:
            con = self._connection()
            try:
                self._check_identity()
                if wait is None:
                    con.execute("BEGIN IMMEDIATE")
                else:
                    con.execute(f"PRAGMA busy_timeout = {max(1, int(wait * 1000))}")
                    try:
                        con.execute("BEGIN IMMEDIATE")
                    except sqlite3.OperationalError as exc:
                        if is_damage(exc):
                            raise
                        raise IndexBusy(str(exc)) from exc
                    finally:
                        con.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
                try:
                    yield IndexTx(con, writable=True, file_size=self._file_size)
                    con.execute("COMMIT")
                    _count_commit(self.root_ident)
                except BaseException:
                    try:
                        con.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                    raise
            except sqlite3.DatabaseError as exc:
                self._damaged(exc)
                raise
        finally:
            self._lock.release()

    @contextmanager
    def snapshot(self) -> Iterator[IndexTx]:
        """A read transaction (a consistent snapshot; writers are not blocked)."""
        with self._lock:
            con = self._connection()
            try:
                self._check_identity()
                con.execute("BEGIN")
                try:
                    yield IndexTx(con, writable=False, file_size=self._file_size)
                finally:
                    con.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                self._damaged(exc)
                raise

    # ------------------------------------------------------------------ key views
    def view_version(self, check: bool = False) -> tuple[int, int]:
        """``(generation, PRAGMA data_version)`` of the view connection: the second number
        changes whenever any other connection (of any process, this one's writer included)
        has committed to the index. With ``check``, first make sure the index file is
        still the one opened (a replaced one is reported as damage). Raises
        :class:`IndexUnavailable` while the index is rebuilt or closed."""
        with self._view_lock:
            con = self._view_connection()
            try:
                if check:
                    self._check_identity()
                (version,) = con.execute("PRAGMA data_version").fetchone()
            except sqlite3.DatabaseError as exc:
                self._damaged(exc)
                raise
            return self.generation, int(version)

    @contextmanager
    def view_snapshot(self) -> Iterator[IndexTx]:
        """A read transaction on the view connection (never waits for this process's
        writers; checks first that the index file is still the one opened)."""
        with self._view_lock:
            con = self._view_connection()
            try:
                self._check_identity()
                con.execute("BEGIN")
                try:
                    yield IndexTx(con, writable=False)
                finally:
                    con.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                self._damaged(exc)
                raise

    def _view_connection(self) -> sqlite3.Connection:
        if self.unavailable is not None:
            raise IndexUnavailable(self.unavailable)
        con = self._view_con
        if con is None:
            raise IndexUnavailable("index is closed")
        return con
