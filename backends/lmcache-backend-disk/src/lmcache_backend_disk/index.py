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

Files are the truth; the index is bookkeeping. It is also *shared*, so it is input to
validate like anything else in the directory: every value read from it is checked before
use (paths against the object/temporary-file shapes, owner ids against their fixed format,
sizes and totals against their range; rows that fail are dropped and totals recomputed),
its schema is audited at open (a trigger that is not ours is dropped), ``PRAGMA
quick_check`` runs when an existing index is opened, and the index files are reached only
through :class:`~.sandbox.TierDir` checks (no link, one hard link) before and after SQLite
opens them. A damaged, replaced or deleted index is reported to ``on_damage`` (the backend
then moves it aside and rebuilds it from the files, see :mod:`.recovery`).

Files are the truth; the index is bookkeeping. Every change that must agree with the files
(reserve + evict, rename + record, remove) happens inside one ``BEGIN IMMEDIATE``
transaction, which also serialises it against every other process. When the two disagree
anyway (a process killed between an unlink and its commit, files copied in by hand) the
error is on the safe side - a row without a file over-counts usage - and heals itself: an
eviction or read that finds no file drops the row, and the rows of dead writers are
settled when their owner is found dead.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from .layout import INDEX_FILE, META_DIR, is_object_relpath, is_temp_relpath_of
from .owners import is_owner_id
from .sandbox import TierDir

__all__ = [
    "IndexBusy",
    "IndexDamaged",
    "IndexTx",
    "IndexUnavailable",
    "SharedIndex",
    "is_damage",
]

log = logging.getLogger("lmcache_core.disk")

#: Largest size accepted for one object (and one reservation) read from the index.
MAX_SIZE = 1 << 48
#: Longest pin lifetime honoured (a pin row claiming more is ignored).
MAX_PIN_S = 86400.0
#: Largest value accepted for the totals.
MAX_TOTAL = 1 << 62
_HEX16 = "[0-9a-f]" * 16
_BAD_OWNER = f"typeof(owner) != 'text' OR length(owner) != 16 OR owner NOT GLOB '{_HEX16}'"
_BAD_SIZE = f"typeof(size) != 'integer' OR size < 0 OR size > {MAX_SIZE}"

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


class IndexUnavailable(sqlite3.OperationalError):
    """The index is being rebuilt (or is closed): index work is refused meanwhile."""


class IndexDamaged(sqlite3.DatabaseError):
    """The index is damaged, tampered with beyond repair in place, or was replaced or
    deleted while open."""


#: SQLite result codes (primary, or extended where given) that mean the index file itself
#: is unusable: corrupt, not a database, truncated, or moved/deleted under the connection.
_DAMAGE_CODES = {11, 26, 522, 1032}  # CORRUPT, NOTADB, IOERR_SHORT_READ, READONLY_DBMOVED
_DAMAGE_TEXT = ("malformed", "no such table", "no such column", "not a database")


def is_damage(exc: BaseException) -> bool:
    """Whether ``exc`` says the index file is damaged (to be moved aside and rebuilt),
    rather than busy, full, read-only or closed."""
    if isinstance(exc, IndexDamaged):
        return True
    if not isinstance(exc, sqlite3.DatabaseError) or isinstance(
        exc, IndexBusy | IndexUnavailable | sqlite3.ProgrammingError
    ):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and (code in _DAMAGE_CODES or code & 0xFF in (11, 26)):
        return True
    text = str(exc).lower()
    return any(t in text for t in _DAMAGE_TEXT)


def _size(v: object) -> int | None:
    """``v`` if it is a plausible size (an int in ``0..MAX_SIZE``), else ``None``."""
    return v if type(v) is int and 0 <= v <= MAX_SIZE else None


def _time(v: object) -> float | None:
    """``v`` as a time if it is a plausible unix time, else ``None``."""
    if type(v) is not float and type(v) is not int:
        return None
    t = float(v)
    return t if 0.0 <= t < 1e11 else None


class IndexTx:
    """Operations inside one index transaction (see :meth:`SharedIndex.transaction`).

    Everything read is validated: rows that fail are left out (and, in a write
    transaction, deleted, with the totals recomputed)."""

    def __init__(
        self,
        con: sqlite3.Connection,
        writable: bool,
        file_size: Callable[[str], int | None] | None = None,
    ) -> None:
        self._con = con
        self.writable = writable
        self._file_size = file_size
        #: Rows dropped by validation in this transaction.
        self.dropped = 0

    # -- usage ---------------------------------------------------------------------
    def totals(self) -> tuple[int, int]:
        """``(used bytes, entry count)``; used bytes include pending writes. Values out of
        range are recomputed from the rows (and stored, in a write transaction)."""
        row = self._con.execute("SELECT used, entries FROM totals WHERE id = 1").fetchone()
        if row is not None:
            used, entries = row
            if (
                type(used) is int
                and type(entries) is int
                and 0 <= used <= MAX_TOTAL
                and 0 <= entries <= MAX_TOTAL
            ):
                return used, entries
        return self.recompute_totals()

    def used(self) -> int:
        return self.totals()[0]

    def recompute_totals(self) -> tuple[int, int]:
        """Drop rows with invalid sizes or owners (write transaction), then set the totals
        from the rows; returns them."""
        con = self._con
        if self.writable:
            bad = con.execute(f"SELECT path FROM entries WHERE {_BAD_SIZE}").fetchall()
            self._repair_sizes([p for (p,) in bad])
            n = con.execute(f"DELETE FROM pending WHERE {_BAD_SIZE} OR {_BAD_OWNER}").rowcount
            n += con.execute(f"DELETE FROM pins WHERE {_BAD_OWNER}").rowcount
            self.dropped += n
        where = "" if self.writable else f" WHERE NOT ({_BAD_SIZE})"
        used_e, count = con.execute(
            f"SELECT COALESCE(SUM(size), 0), COUNT(*) FROM entries{where}"
        ).fetchone()
        (used_p,) = con.execute(f"SELECT COALESCE(SUM(size), 0) FROM pending{where}").fetchone()
        used, entries = int(used_e) + int(used_p), int(count)
        if self.writable:
            con.execute("INSERT OR REPLACE INTO totals(id, used, entries) VALUES (1, ?, ?)",
                        (used, entries))  # fmt: skip
        return used, entries

    def audit_schema(self) -> bool:
        """Drop triggers that are not exactly ours (a planted trigger could falsify the
        totals) and create what is missing; a table or index that differs from ours is
        :class:`IndexDamaged`. ``True`` when a trigger was dropped."""
        dropped = False
        con = self._con
        for typ, name, tbl, sql in con.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master"
        ).fetchall():
            if not isinstance(name, str) or name.startswith("sqlite_"):
                continue
            want = _EXPECTED.get(name)
            if typ == "trigger":
                if want != (typ, tbl, sql):
                    con.execute(f'DROP TRIGGER "{name.replace(chr(34), chr(34) * 2)}"')
                    dropped = True
            elif want is not None and want != (typ, tbl, sql):
                raise IndexDamaged(f"index {typ} {name!r} is not the expected one")
        for stmt in _SCHEMA.split(";\n"):
            if stmt.strip():
                con.execute(stmt)
        return dropped

    def audit(self) -> bool:
        """Check the schema (:meth:`audit_schema`) and the totals against the rows (sizes
        range-checked); fix what is wrong. ``True`` when something was."""
        if self.audit_schema():
            self.recompute_totals()
            return True
        before = self._con.execute("SELECT used, entries FROM totals WHERE id = 1").fetchone()
        bad = self._con.execute(
            f"SELECT (SELECT COUNT(*) FROM entries WHERE {_BAD_SIZE}) + "
            f"(SELECT COUNT(*) FROM pending WHERE {_BAD_SIZE} OR {_BAD_OWNER}) + "
            f"(SELECT COUNT(*) FROM pins WHERE {_BAD_OWNER})"
        ).fetchone()[0]
        if bad:
            self.recompute_totals()
            return True
        (used_e, count), (used_p,) = (
            self._con.execute("SELECT COALESCE(SUM(size), 0), COUNT(*) FROM entries").fetchone(),
            self._con.execute("SELECT COALESCE(SUM(size), 0) FROM pending").fetchone(),
        )
        if before is None or tuple(before) != (int(used_e) + int(used_p), int(count)):
            self.recompute_totals()
            return True
        return False

    def sanitize(self) -> int:
        """Drop every row that fails validation (object and temporary paths included: a
        full scan, for ``reconcile``), then recompute the totals; the rows dropped."""
        before = self.dropped
        bad = [
            p
            for p, size in self._con.execute("SELECT path, size FROM entries").fetchall()
            if not (isinstance(p, str) and is_object_relpath(p)) or _size(size) is None
        ]
        self._repair_sizes(bad)
        rows = self._con.execute("SELECT id, path, tmp FROM pending").fetchall()
        bad_ids = [
            i
            for i, p, t in rows
            if not (isinstance(p, str) and isinstance(t, str) and is_temp_relpath_of(p, t))
        ]
        self._con.executemany("DELETE FROM pending WHERE id = ?", [(i,) for i in bad_ids])
        self.dropped += len(bad_ids)
        self.recompute_totals()
        return self.dropped - before

    def _repair_sizes(self, paths: list[Any]) -> None:
        """Rows with a valid object path but an invalid size get the size of their file
        (so the file stays counted); the others are deleted."""
        for p in paths:
            size = (
                self._file_size(p)
                if self._file_size is not None and isinstance(p, str) and is_object_relpath(p)
                else None
            )
            if size is None:
                self._con.execute("DELETE FROM entries WHERE path = ?", (p,))
            else:
                self._con.execute("UPDATE entries SET size = ? WHERE path = ?", (size, p))
            self.dropped += 1

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
        """The size recorded for ``path`` (``None``: no row, or an invalid one)."""
        row = self._con.execute("SELECT size FROM entries WHERE path = ?", (path,)).fetchone()
        return None if row is None else _size(row[0])

    def lru(self, limit: int, offset: int = 0, now: float = 0.0) -> list[tuple[str, int]]:
        """Valid entries, least recently used first, leaving out those pinned past ``now``
        (a pin expiring more than :data:`MAX_PIN_S` after ``now`` is invalid: ignored).
        Invalid rows met on the way are dropped (write transaction) and the totals
        recomputed."""
        rows = self._con.execute(
            "SELECT path, size FROM entries WHERE NOT EXISTS (SELECT 1 FROM pins "
            "WHERE pins.path = entries.path AND pins.expires > ? AND pins.expires <= ?) "
            "ORDER BY atime, path LIMIT ? OFFSET ?",
            (now, now + MAX_PIN_S, limit, offset),
        ).fetchall()
        out: list[tuple[str, int]] = []
        bad = []
        for p, size in rows:
            ok = _size(size)
            if isinstance(p, str) and ok is not None and is_object_relpath(p):
                out.append((p, ok))
            else:
                bad.append(p)
        if bad and self.writable:
            self._repair_sizes(bad)
            self.recompute_totals()
            return self.lru(limit, offset, now)
        return out

    def touch(self, items: Iterable[tuple[str, float]]) -> None:
        """Move entries up the LRU order (rows that do not exist are left alone)."""
        self._con.executemany(
            "UPDATE entries SET atime = ?1 WHERE path = ?2 AND atime < ?1",
            [(t, p) for p, t in items],
        )

    def entries(self) -> dict[str, int]:
        """Every valid entry's size, by path."""
        out = {}
        for p, size in self._con.execute("SELECT path, size FROM entries"):
            ok = _size(size)
            if isinstance(p, str) and ok is not None and is_object_relpath(p):
                out[p] = ok
        return out

    def atimes(self) -> dict[str, float]:
        """Every valid entry's last access time, by path."""
        out = {}
        for p, t in self._con.execute("SELECT path, atime FROM entries"):
            ok = _time(t)
            if isinstance(p, str) and ok is not None and is_object_relpath(p):
                out[p] = ok
        return out

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
        """Owner ids with pending writes (only well-formed ids)."""
        rows = self._con.execute("SELECT DISTINCT owner FROM pending").fetchall()
        return [r[0] for r in rows if is_owner_id(r[0])]

    def pending_of(self, owner: str) -> list[tuple[int, str, str, int]]:
        """``(id, path, tmp, size)`` of ``owner``'s pending writes. Rows whose paths are
        not a temporary file of an object location, or whose size is invalid, are deleted
        here (write transaction) without being returned: nothing they name is touched."""
        rows = self._con.execute(
            "SELECT id, path, tmp, size FROM pending WHERE owner = ?", (owner,)
        ).fetchall()
        out = []
        for i, p, t, size in rows:
            ok = _size(size)
            if (
                type(i) is int
                and isinstance(p, str)
                and isinstance(t, str)
                and ok is not None
                and is_temp_relpath_of(p, t)
            ):
                out.append((i, p, t, ok))
            elif self.writable:
                self._con.execute("DELETE FROM pending WHERE id = ?", (i,))
                self.dropped += 1
        return out

    def pending_tmp_names(self) -> set[str]:
        return {r[0] for r in self._con.execute("SELECT tmp FROM pending") if isinstance(r[0], str)}

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
        """Owner ids holding pins (only well-formed ids)."""
        rows = self._con.execute("SELECT DISTINCT owner FROM pins").fetchall()
        return [r[0] for r in rows if is_owner_id(r[0])]

    def pinned_count(self, now: float) -> int:
        row = self._con.execute(
            "SELECT COUNT(*) FROM pins WHERE expires > ? AND expires <= ?", (now, now + MAX_PIN_S)
        ).fetchone()
        return int(row[0]) if row else 0

    # -- meta --------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        row = self._con.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
        return row[0] if row is not None and isinstance(row[0], str) else None

    def set_meta(self, key: str, value: str) -> None:
        self._con.execute(
            "INSERT INTO meta(k, v) VALUES (?, ?) ON CONFLICT(k) DO UPDATE SET v = excluded.v",
            (key, value),
        )


def _expected_schema() -> dict[str, tuple[str, str, str | None]]:
    """``name -> (type, table, sql)`` of every schema object :data:`_SCHEMA` creates."""
    con = sqlite3.connect(":memory:")
    try:
        for stmt in _SCHEMA.split(";\n"):
            if stmt.strip():
                con.execute(stmt)
        rows = con.execute("SELECT type, name, tbl_name, sql FROM sqlite_master").fetchall()
    finally:
        con.close()
    return {name: (typ, tbl, sql) for typ, name, tbl, sql in rows}


_EXPECTED = _expected_schema()
_INDEX_FILES = ("", "-wal", "-shm", "-journal")


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
        except sqlite3.DatabaseError as exc:
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
        self._con = con
        return complete

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
