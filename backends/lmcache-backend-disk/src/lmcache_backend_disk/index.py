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
``changes(seq, path, present)``
    one row per entry inserted (``present`` 1) or deleted (0), in commit order, filled by
    triggers: what each process's in-memory view of the keys (:mod:`.view`) reads to
    catch up incrementally. Writers prune it to the last :data:`CHANGES_KEEP` rows (the
    ``changes_floor`` meta value says up to which ``seq`` rows are gone; a view that is
    further behind reloads the entries).
``pins(id, path, owner, expires)``
    one row per pin (:meth:`DiskBackend.pin`): eviction skips an entry while it has a pin
    whose ``expires`` (wall clock) has not passed.

Files are the truth; the index is bookkeeping. It is also *shared*, so it is input to
validate like anything else in the directory: every value read from it is checked before
use (paths against the object/temporary-file shapes, owner ids against their fixed format,
sizes and totals against their range; rows that fail are dropped and totals recomputed),
its schema is audited (a trigger that is not ours is dropped). Opening the index file and
running transactions on it is :mod:`.shared_index`.

Files are the truth; the index is bookkeeping. Every change that must agree with the files
(reserve + evict, rename + record, remove) happens inside one ``BEGIN IMMEDIATE``
transaction, which also serialises it against every other process. When the two disagree
anyway (a process killed between an unlink and its commit, files copied in by hand) the
error is on the safe side - a row without a file over-counts usage - and heals itself: an
eviction or read that finds no file drops the row, and the rows of dead writers are
settled when their owner is found dead.
"""

from __future__ import annotations

import secrets
import sqlite3
from collections.abc import Callable, Iterable
from typing import Any

from .layout import is_object_relpath, is_temp_relpath_of
from .owners import is_owner_id

__all__ = [
    "IndexBusy",
    "IndexDamaged",
    "IndexTx",
    "IndexUnavailable",
    "is_damage",
    "text_or_bytes",
]


#: Largest size accepted for one object (and one reservation) read from the index.
MAX_SIZE = 1 << 48
#: Longest pin lifetime honoured (a pin row claiming more is ignored).
MAX_PIN_S = 86400.0
#: Largest value accepted for the totals.
MAX_TOTAL = 1 << 62
_HEX16 = "[0-9a-f]" * 16
_BAD_OWNER = f"typeof(owner) != 'text' OR length(owner) != 16 OR owner NOT GLOB '{_HEX16}'"
_BAD_SIZE = f"typeof(size) != 'integer' OR size < 0 OR size > {MAX_SIZE}"

#: Version 1 without the change log (older releases) and with it share the directory: the
#: log is an addition that older code tolerates (it drops the log's triggers as foreign at
#: its schema audits; the key views then fall back to the files, see :mod:`.view`), so the
#: version is not bumped (an older process would take a bumped index for damage and
#: rebuild it under the newer ones).
SCHEMA_VERSION = "1"
#: Meta key: a token recorded each time the change log's triggers are (re)created.
CHANGE_LOG_EPOCH = "changes_epoch"
#: Rows of the ``changes`` table kept by :meth:`IndexTx.prune_changes`.
CHANGES_KEEP = 50_000

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
CREATE TABLE IF NOT EXISTS changes(
    seq INTEGER PRIMARY KEY AUTOINCREMENT, path TEXT NOT NULL, present INTEGER NOT NULL);
CREATE TRIGGER IF NOT EXISTS changes_ins AFTER INSERT ON entries BEGIN
    INSERT INTO changes(path, present) VALUES (NEW.path, 1); END;
CREATE TRIGGER IF NOT EXISTS changes_del AFTER DELETE ON entries BEGIN
    INSERT INTO changes(path, present) VALUES (OLD.path, 0); END;
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


def text_or_bytes(raw: bytes) -> str | bytes:
    """The connection's text factory: TEXT that is not valid UTF-8 (a damaged or tampered
    index) comes back as ``bytes``, which no validation accepts, instead of raising."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


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
        :class:`IndexDamaged`. ``True`` when a trigger was dropped.

        When the change log's triggers are (re)created, a new :data:`CHANGE_LOG_EPOCH`
        is recorded: changes made while they were missing were not logged (an older
        version of this backend, whose audit drops them as foreign, shares the
        directory), so every key view reloads instead of trusting the log."""
        dropped = False
        con = self._con
        log_was_on = self.change_log_epoch() is not None
        for typ, name, tbl, sql in con.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master"
        ).fetchall():
            if not isinstance(name, str):
                raise IndexDamaged(f"a schema object's name is not text: {name!r}")
            if name.startswith("sqlite_"):
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
        if not log_was_on and self.writable:
            self.set_meta(CHANGE_LOG_EPOCH, secrets.token_hex(8))
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

    def integrity_check(self) -> None:
        """``PRAGMA integrity_check`` (also compares every index with its table, which
        ``quick_check`` at open does not): :class:`IndexDamaged` unless it passes."""
        rows = self._con.execute("PRAGMA integrity_check").fetchall()
        if rows != [("ok",)]:
            raise IndexDamaged(f"integrity_check: {rows[:3]}")

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
            # matched on the raw bytes: a path that is not valid text (read back as bytes,
            # see :func:`text_or_bytes`) must still be found
            raw = p if isinstance(p, bytes) else str(p).encode("utf-8", "surrogatepass")
            args: tuple[object, ...]
            if size is None:
                sql, args = "DELETE FROM entries WHERE CAST(path AS BLOB) = ?", (raw,)
            else:
                sql, args = "UPDATE entries SET size = ? WHERE CAST(path AS BLOB) = ?", (size, raw)
            if self._con.execute(sql, args).rowcount == 0:
                # the row was read through an index whose copy differs from the table
                raise IndexDamaged("an index of the entries table disagrees with the table")
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

    # -- change log (the per-process key views) ------------------------------------------
    def prune_changes(self, keep: int = CHANGES_KEEP) -> int:
        """Delete all but the last ``keep`` rows of the change log; rows deleted."""
        (last,) = self._con.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()
        if type(last) is not int or last <= keep:
            return 0
        cut = last - keep
        n = self._con.execute("DELETE FROM changes WHERE seq <= ?", (cut,)).rowcount
        if n:
            self.set_meta("changes_floor", str(cut))
        return n

    def changes_since(self, seq: int) -> tuple[int, int, list[tuple[str, bool]]] | None:
        """``(floor, last seq, [(path, present)])``: the changes after ``seq`` in commit
        order, or ``None`` when the log cannot tell (pruned past ``seq``, or ``seq`` is
        ahead of it: another index file). Malformed rows are left out."""
        floor_text = self.meta("changes_floor")
        floor = int(floor_text) if floor_text is not None and floor_text.isdigit() else 0
        (last,) = self._con.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()
        if type(last) is not int or seq < floor or seq > last:
            return None
        out = [
            (p, bool(present))
            for s, p, present in self._con.execute(
                "SELECT seq, path, present FROM changes WHERE seq > ? ORDER BY seq", (seq,)
            )
            if type(s) is int and isinstance(p, str) and present in (0, 1)
        ]
        return floor, last, out

    def change_log_epoch(self) -> str | None:
        """The change log's epoch (see :meth:`audit_schema`), or ``None`` when the log is
        off now: one of its triggers is missing or not exactly ours, or no epoch was
        recorded since they were created. A key view trusts the log only between two
        reads of the same epoch."""
        rows = self._con.execute(
            "SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'trigger' "
            "AND name IN (?, ?)",
            _CHANGE_TRIGGERS,
        ).fetchall()
        if len(rows) != len(_CHANGE_TRIGGERS):
            return None
        for name, tbl, sql in rows:
            if _EXPECTED.get(name) != ("trigger", tbl, sql):
                return None
        return self.meta(CHANGE_LOG_EPOCH)

    def last_change(self) -> int:
        """The ``seq`` of the latest change (0: none)."""
        (last,) = self._con.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()
        return last if type(last) is int else 0

    def paths_under(self, prefix: str) -> list[str]:
        """Paths of the entries that start with ``prefix`` (unvalidated text)."""
        hi = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        return [
            p
            for (p,) in self._con.execute(
                "SELECT path FROM entries WHERE path >= ? AND path < ?", (prefix, hi)
            )
            if isinstance(p, str)
        ]

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
#: The triggers that fill the ``changes`` table.
_CHANGE_TRIGGERS = ("changes_ins", "changes_del")
assert all(_EXPECTED[name][0] == "trigger" for name in _CHANGE_TRIGGERS)
