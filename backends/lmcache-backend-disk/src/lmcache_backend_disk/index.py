"""The shared index: usage and LRU order of one tier directory, for every process using it.

A SQLite database in WAL mode under ``<root>/.lmcache-disk/``:

``entries(path, size, atime)``
    one row per published object (relative path, bytes on disk, last access time).
``pending(id, owner, path, tmp, size, started)``
    one row per write in progress: space is *reserved* before a temporary file is created,
    so usage counts objects being written and the bound holds at every instant.
``totals``
    ``used`` (bytes of entries + pending) and ``entries``, kept exact by triggers, so a
    reservation reads usage in O(1) instead of summing 100k rows.
``pins(id, path, owner, expires)``
    one row per pin (:meth:`DiskBackend.pin`): eviction skips an entry while it has a pin
    whose ``expires`` (wall clock) has not passed.

Files are the truth; the index is bookkeeping. Every change that must agree with the files
(reserve + evict, rename + record, remove) happens inside one ``BEGIN IMMEDIATE``
transaction, which also serialises it against every other process. When the two disagree
anyway (a process killed between an unlink and its commit, files copied in by hand) the
error is on the safe side - a row without a file over-counts usage - and heals itself: an
eviction or read that finds no file drops the row, and the rows of dead writers are
settled when their owner is found dead.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

__all__ = ["IndexBusy", "IndexTx", "SharedIndex"]

SCHEMA_VERSION = "1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries(
    path TEXT PRIMARY KEY, size INTEGER NOT NULL, atime REAL NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_by_atime ON entries(atime);
CREATE TABLE IF NOT EXISTS pending(
    id INTEGER PRIMARY KEY AUTOINCREMENT, owner TEXT NOT NULL, path TEXT NOT NULL,
    tmp TEXT NOT NULL, size INTEGER NOT NULL, started REAL NOT NULL);
CREATE INDEX IF NOT EXISTS pending_by_owner ON pending(owner);
CREATE TABLE IF NOT EXISTS totals(
    id INTEGER PRIMARY KEY CHECK (id = 1), used INTEGER NOT NULL, entries INTEGER NOT NULL);
INSERT OR IGNORE INTO totals VALUES (1, 0, 0);
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pins(
    id INTEGER PRIMARY KEY AUTOINCREMENT, path TEXT NOT NULL, owner TEXT NOT NULL,
    expires REAL NOT NULL);
CREATE INDEX IF NOT EXISTS pins_by_path ON pins(path);
CREATE INDEX IF NOT EXISTS pins_by_owner ON pins(owner);
CREATE TRIGGER IF NOT EXISTS entries_ins AFTER INSERT ON entries BEGIN
    UPDATE totals SET used = used + NEW.size, entries = entries + 1; END;
CREATE TRIGGER IF NOT EXISTS entries_del AFTER DELETE ON entries BEGIN
    UPDATE totals SET used = used - OLD.size, entries = entries - 1; END;
CREATE TRIGGER IF NOT EXISTS entries_upd AFTER UPDATE OF size ON entries BEGIN
    UPDATE totals SET used = used - OLD.size + NEW.size; END;
CREATE TRIGGER IF NOT EXISTS pending_ins AFTER INSERT ON pending BEGIN
    UPDATE totals SET used = used + NEW.size; END;
CREATE TRIGGER IF NOT EXISTS pending_del AFTER DELETE ON pending BEGIN
    UPDATE totals SET used = used - OLD.size; END;
"""


class IndexBusy(sqlite3.OperationalError):
    """A bounded wait for the index's write lock ran out (nothing was done)."""


class IndexTx:
    """Operations inside one index transaction (see :meth:`SharedIndex.transaction`)."""

    def __init__(self, con: sqlite3.Connection) -> None:
        self._con = con

    # -- usage ---------------------------------------------------------------------
    def totals(self) -> tuple[int, int]:
        """``(used bytes, entry count)``; used bytes include pending writes."""
        row = self._con.execute("SELECT used, entries FROM totals WHERE id = 1").fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def used(self) -> int:
        return self.totals()[0]

    # -- entries -------------------------------------------------------------------
    def upsert_entry(self, path: str, size: int, atime: float) -> None:
        self._con.execute(
            "INSERT INTO entries(path, size, atime) VALUES (?, ?, ?) "
            "ON CONFLICT(path) DO UPDATE SET size = excluded.size, atime = excluded.atime",
            (path, size, atime),
        )

    def delete_entry(self, path: str) -> bool:
        return self._con.execute("DELETE FROM entries WHERE path = ?", (path,)).rowcount > 0

    def entry_size(self, path: str) -> int | None:
        row = self._con.execute("SELECT size FROM entries WHERE path = ?", (path,)).fetchone()
        return None if row is None else int(row[0])

    def lru(self, limit: int, offset: int = 0, now: float = 0.0) -> list[tuple[str, int]]:
        """Entries, least recently used first, leaving out those pinned past ``now``."""
        rows = self._con.execute(
            "SELECT path, size FROM entries WHERE NOT EXISTS (SELECT 1 FROM pins "
            "WHERE pins.path = entries.path AND pins.expires > ?) "
            "ORDER BY atime, path LIMIT ? OFFSET ?",
            (now, limit, offset),
        ).fetchall()
        return [(str(p), int(s)) for p, s in rows]

    def touch(self, items: Iterable[tuple[str, float]]) -> None:
        """Move entries up the LRU order (rows that do not exist are left alone)."""
        self._con.executemany(
            "UPDATE entries SET atime = ?1 WHERE path = ?2 AND atime < ?1",
            [(t, p) for p, t in items],
        )

    def entries(self) -> dict[str, int]:
        """Every entry's size, by path."""
        return {str(p): int(s) for p, s in self._con.execute("SELECT path, size FROM entries")}

    def atimes(self) -> dict[str, float]:
        return {str(p): float(t) for p, t in self._con.execute("SELECT path, atime FROM entries")}

    def clear_entries(self) -> None:
        self._con.execute("DELETE FROM entries")

    # -- pending writes ----------------------------------------------------------------
    def add_pending(self, owner: str, path: str, tmp: str, size: int, now: float) -> int:
        cur = self._con.execute(
            "INSERT INTO pending(owner, path, tmp, size, started) VALUES (?, ?, ?, ?, ?)",
            (owner, path, tmp, size, now),
        )
        assert cur.lastrowid is not None
        return int(cur.lastrowid)

    def delete_pending(self, pending_id: int) -> None:
        self._con.execute("DELETE FROM pending WHERE id = ?", (pending_id,))

    def pending_owners(self) -> list[str]:
        return [str(r[0]) for r in self._con.execute("SELECT DISTINCT owner FROM pending")]

    def pending_of(self, owner: str) -> list[tuple[int, str, str, int]]:
        rows = self._con.execute(
            "SELECT id, path, tmp, size FROM pending WHERE owner = ?", (owner,)
        ).fetchall()
        return [(int(i), str(p), str(t), int(s)) for i, p, t, s in rows]

    def pending_tmp_names(self) -> set[str]:
        return {str(r[0]) for r in self._con.execute("SELECT tmp FROM pending")}

    # -- pins ----------------------------------------------------------------------------
    def add_pins(
        self, owner: str, paths: list[str], expires: float, now: float
    ) -> list[int | None]:
        """Pin each path that has an entry (one pin row each); its id, or ``None``.
        Expired pins of every owner are dropped on the way."""
        con = self._con
        con.execute("DELETE FROM pins WHERE expires <= ?", (now,))
        out: list[int | None] = []
        for path in paths:
            if con.execute("SELECT 1 FROM entries WHERE path = ?", (path,)).fetchone() is None:
                out.append(None)
                continue
            cur = con.execute(
                "INSERT INTO pins(path, owner, expires) VALUES (?, ?, ?)", (path, owner, expires)
            )
            out.append(cur.lastrowid)
        return out

    def delete_pins(self, ids: Iterable[int]) -> None:
        self._con.executemany("DELETE FROM pins WHERE id = ?", [(i,) for i in ids])

    def delete_pins_of(self, owner: str) -> int:
        return self._con.execute("DELETE FROM pins WHERE owner = ?", (owner,)).rowcount

    def pin_owners(self) -> list[str]:
        return [str(r[0]) for r in self._con.execute("SELECT DISTINCT owner FROM pins")]

    def pinned_count(self, now: float) -> int:
        row = self._con.execute("SELECT COUNT(*) FROM pins WHERE expires > ?", (now,)).fetchone()
        return int(row[0]) if row else 0

    # -- meta --------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        row = self._con.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self._con.execute(
            "INSERT INTO meta(k, v) VALUES (?, ?) ON CONFLICT(k) DO UPDATE SET v = excluded.v",
            (key, value),
        )


class SharedIndex:
    """One connection to a tier's index, usable from any thread (calls are serialised)."""

    def __init__(self, path: str, file_mode: int, busy_timeout: float = 60.0) -> None:
        self.path = path
        self.file_mode = file_mode
        self.busy_timeout = busy_timeout
        self._con: sqlite3.Connection | None = None
        self._lock = threading.Lock()

    def open(self) -> bool:
        """Open (creating it if needed); ``True`` when the index existed and is complete.

        An unreadable index file is moved aside (``.corrupt``) and a new one is created; the
        caller then rebuilds it from the files.
        """
        existed = os.path.exists(self.path)
        try:
            return self._open() and existed
        except sqlite3.DatabaseError:
            self.close()
            for suffix in ("", "-wal", "-shm"):
                try:
                    os.replace(self.path + suffix, self.path + ".corrupt" + suffix)
                except FileNotFoundError:
                    pass
            self._open()
            return False

    def _open(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, self.file_mode)
        os.close(fd)
        con = sqlite3.connect(
            self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False
        )
        try:
            con.execute("PRAGMA journal_mode=WAL").fetchone()
            con.execute("PRAGMA synchronous=NORMAL")
            con.execute("BEGIN IMMEDIATE")
            for stmt in _SCHEMA.split(";\n"):
                if stmt.strip():
                    con.execute(stmt)
            tx = IndexTx(con)
            version = tx.meta("schema")
            if version is None:
                tx.set_meta("schema", SCHEMA_VERSION)
            elif version != SCHEMA_VERSION:
                con.execute("ROLLBACK")
                raise sqlite3.DatabaseError(f"index schema {version!r}, expected {SCHEMA_VERSION}")
            complete = tx.meta("complete") == "1"
            con.execute("COMMIT")
        except BaseException:
            con.close()
            raise
        self._con = con
        return complete

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                self._con.close()
                self._con = None

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
            con = self._con
            if con is None:
                raise sqlite3.ProgrammingError("index is closed")
            if wait is None:
                con.execute("BEGIN IMMEDIATE")
            else:
                con.execute(f"PRAGMA busy_timeout = {max(1, int(wait * 1000))}")
                try:
                    con.execute("BEGIN IMMEDIATE")
                except sqlite3.OperationalError as exc:
                    raise IndexBusy(str(exc)) from exc
                finally:
                    con.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
            try:
                yield IndexTx(con)
                con.execute("COMMIT")
            except BaseException:
                try:
                    con.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
                raise
        finally:
            self._lock.release()

    @contextmanager
    def snapshot(self) -> Iterator[IndexTx]:
        """A read transaction (a consistent snapshot; writers are not blocked)."""
        with self._lock:
            con = self._con
            if con is None:
                raise sqlite3.ProgrammingError("index is closed")
            con.execute("BEGIN")
            try:
                yield IndexTx(con)
            finally:
                con.execute("COMMIT")
