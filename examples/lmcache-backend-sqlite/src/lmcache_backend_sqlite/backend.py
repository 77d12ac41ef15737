"""A SQLite file as an lmcache-core tier: one row per KV chunk object.

Written only against lmcache-core's public API: the byte-store base class
(:class:`lmcache_core.blob.BlobBackend`) provides the object format, checksums (a corrupt
row is a miss and is deleted), threads, batching and the maintenance interface; this
module stores and fetches named byte strings.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from lmcache_core.backend import Capabilities
from lmcache_core.blob import BlobBackend, ObjectStat
from lmcache_core.config.options import build_options, option
from lmcache_core.keys import Namespace

SCHEMA = "CREATE TABLE IF NOT EXISTS objects (name TEXT PRIMARY KEY, data BLOB NOT NULL, mtime REAL NOT NULL)"


@dataclass(frozen=True)
class SQLiteOptions:
    """Options of the ``sqlite`` backend."""

    path: str = option(kind="path", doc="The database file (created when missing).")
    timeout_s: float = option(30.0, minimum=0, doc="How long to wait for another writer's lock.")
    synchronous: str = option(
        "normal",
        choices=("off", "normal", "full"),
        doc="SQLite's synchronous setting: 'full' also survives a power cut.",
    )
    max_concurrency: int = option(4, minimum=1, doc="Operations in flight (threads).")


class SQLiteBackend(BlobBackend):
    """KV chunks as rows of a SQLite database, shared by every process that opens it."""

    Options = SQLiteOptions
    capabilities = Capabilities(persistent=True, shared=True)
    interface_version = "1.0"  # the lmcache_core.interface version it implements

    def __init__(
        self, options: Any = None, *, namespace: Namespace | None = None, name: str | None = None
    ) -> None:
        opts = build_options(SQLiteOptions, options)
        super().__init__(opts, namespace=namespace, name=name or "sqlite")
        self.path = opts.path
        self.opts = opts
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._idle = threading.Condition()
        self._busy = 0  # operations running: a connection is never closed under one

    def describe_store(self) -> str:
        return f"sqlite://{self.path}"

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection (sqlite3 connections belong to one thread)."""
        with self._idle:
            self._busy += 1
        try:
            db = getattr(self._local, "db", None)
            if db is None:
                db = sqlite3.connect(
                    self.path, timeout=self.opts.timeout_s, isolation_level=None,
                    check_same_thread=False,
                )  # fmt: skip
                db.execute("PRAGMA journal_mode=WAL")  # readers never wait for a writer
                db.execute(f"PRAGMA synchronous={self.opts.synchronous}")
                self._local.db = db
                with self._idle:
                    self._connections.append(db)
            yield db
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def open_store(self) -> None:
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"directory {parent} does not exist")
        with self._db() as db:
            db.execute(SCHEMA)

    def close_store(self) -> None:
        with self._idle:  # operations cancelled by close may still be running: wait
            self._idle.wait_for(lambda: self._busy == 0, timeout=self.opts.timeout_s)
            connections, self._connections = self._connections, []
            self._local = threading.local()
        for db in connections:
            db.close()

    def read_object(self, name: str) -> bytes | None:
        with self._db() as db:
            row = db.execute("SELECT data FROM objects WHERE name = ?", (name,)).fetchone()
        return None if row is None else row[0]

    def read_range(self, name: str, start: int, length: int) -> bytes | None:
        with self._db() as db:
            row = db.execute(
                "SELECT substr(data, ?, ?) FROM objects WHERE name = ?", (start + 1, length, name)
            ).fetchone()
        return None if row is None else row[0]

    def write_object(self, name: str, data: memoryview) -> None:
        # one statement is one transaction: readers see the old row or the new one
        with self._db() as db:
            db.execute(
                "INSERT OR REPLACE INTO objects (name, data, mtime) VALUES (?, ?, ?)",
                (name, data, time.time()),
            )

    def delete_object(self, name: str) -> bool:
        with self._db() as db:
            return db.execute("DELETE FROM objects WHERE name = ?", (name,)).rowcount > 0

    def stat_object(self, name: str) -> ObjectStat | None:
        with self._db() as db:
            row = db.execute(
                "SELECT length(data), mtime FROM objects WHERE name = ?", (name,)
            ).fetchone()
        return None if row is None else ObjectStat(name, row[0], row[1])

    def list_objects(self, prefix: str) -> list[ObjectStat]:
        with self._db() as db:
            rows = db.execute(
                "SELECT name, length(data), mtime FROM objects WHERE substr(name, 1, ?) = ?",
                (len(prefix), prefix),
            ).fetchall()
        return [ObjectStat(n, size, mtime) for n, size, mtime in rows]
