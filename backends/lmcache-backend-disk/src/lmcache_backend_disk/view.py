"""A per-process, in-memory view of which objects of one namespace a disk tier holds.

Lookups (``contains``, ``batched_contains``, the hierarchy's ``lookup_prefix``) answer
from this view instead of an ``lstat`` per key. It is a set of object locations read from
the shared index and kept in step with it incrementally: the index logs every entry
inserted or deleted (its ``changes`` table, in commit order, see :mod:`.index`), and the
view applies the rows after the last one it has seen.

When it catches up (the *visibility delay*):

* after a write transaction committed by this process (any backend on the same
  directory: a put, a removal, an eviction, a repair), at the next lookup;
* after one committed by another process, within ``lookup_refresh_s`` seconds of the
  commit (the view asks the index whether anything changed - SQLite's ``data_version``,
  about 10 µs - at most that often; ``0`` asks at every lookup).

The view trusts the change log only while its triggers are in place and its epoch is
unchanged (:meth:`~.index.IndexTx.change_log_epoch`). An older version of this backend
sharing the directory drops the triggers at its schema audits; the view then cannot
answer (lookups check the files, as without a view) until a newer process's audit
(at its start, then every ``AUDIT_INTERVAL_S``) restores them under a new epoch, and
then reloads.

The view is a hint about the files, like the index it mirrors: a positive can be stale
(the object was evicted or removed since, or a row was forged), and a load then finds no
valid object and reports a miss. Loads never trust the view: every read opens the file
without following links and verifies its size, header, identity and checksum. Paths read
from the index are validated against the object layout before they enter the view.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Sequence

from lmcache_core.keys import CacheEngineKey

from .index import IndexUnavailable
from .layout import is_object_relpath, key_location
from .shared_index import SharedIndex, local_commits

__all__ = ["MEMO_MAX", "KeyView"]

log = logging.getLogger("lmcache_core.disk")

#: Seconds between checks that the index file is still the one the view reads (another
#: process may have replaced a damaged one: the view then reopens it through healing).
IDENTITY_CHECK_S = 1.0
#: Keys whose location is remembered (computing one costs a key string and a digest,
#: ~2 µs); the memo is emptied when it reaches this size.
MEMO_MAX = 1 << 17


class ChangeLogOff(IndexUnavailable):
    """The index's change log cannot be trusted now (see :meth:`IndexTx.change_log_epoch`):
    the view cannot answer, lookups ask the files."""


class KeyView:
    """The locations (``ab/<32 hex>`` or, layout 1, ``ab/cd/<32 hex>``, relative to the
    namespace directory) of every entry the shared index lists under ``ns_dir``, kept
    current as the module says.

    Thread-safe: lookups run in any thread; one thread at a time catches up, and the
    others wait for it (so a lookup never answers from before a commit it must see)."""

    def __init__(self, index: SharedIndex, ns_dir: str, refresh_s: float) -> None:
        self.index = index
        self.ns_dir = ns_dir
        self.prefix = ns_dir + "/"
        self.refresh_s = refresh_s
        self._names: set[str] = set()
        self._ok = False
        self._generation = -1
        self._version = -1
        self._seq = 0
        self._epoch: str | None = None
        self._log_off_said = False
        self._seen_local = -1
        self._next_poll = 0.0
        self._next_check = 0.0
        self._lock = threading.Lock()
        self._memo: dict[CacheEngineKey, str] = {}
        #: Polls of the index, incremental catch-ups, full reloads (for stats and tests).
        self.polls = 0
        self.updates = 0
        self.reloads = 0

    # ------------------------------------------------------------------ locations
    def location(self, key: CacheEngineKey) -> str:
        """Where ``key`` lives under the namespace directory (:func:`.layout.key_location`),
        remembered."""
        loc = self._memo.get(key)
        if loc is None:
            loc = key_location(self.ns_dir, key)
            memo = self._memo
            if len(memo) >= MEMO_MAX:
                memo.clear()
            memo[key] = loc
        return loc

    def locations(self, keys: Sequence[CacheEngineKey]) -> list[str]:
        get = self._memo.get
        locs = [get(k) for k in keys]
        if None in locs:
            locs = [
                loc if loc is not None else self.location(k)
                for k, loc in zip(keys, locs, strict=True)
            ]
        return locs  # type: ignore[return-value]

    # ------------------------------------------------------------------ lookups
    def contains_many(self, keys: Sequence[CacheEngineKey]) -> list[bool] | None:
        """Whether the index lists each key (``None``: the view cannot answer now - the
        index is being rebuilt or cannot be read; ask the files)."""
        names = self.current()
        if names is None:
            return None
        return [loc in names for loc in self.locations(keys)]

    def current(self) -> set[str] | None:
        """The set of locations, caught up as the module says (``None``: unavailable)."""
        if (
            local_commits(self.index.root_ident) != self._seen_local
            or time.monotonic() >= self._next_poll
        ):
            self._catch_up()
        return self._names if self._ok else None

    def invalidate(self) -> None:
        """Make the next lookup ask the index (after this process changed it)."""
        self._next_poll = 0.0

    # ------------------------------------------------------------------ catching up
    def _catch_up(self) -> None:
        with self._lock:
            local = local_commits(self.index.root_ident)
            now = time.monotonic()
            if local == self._seen_local and now < self._next_poll:
                return  # another thread caught up meanwhile
            try:
                check = now >= self._next_check
                if check:
                    self._next_check = now + IDENTITY_CHECK_S
                self._poll(check)
            except (sqlite3.Error, OSError) as exc:
                if self._ok and not isinstance(exc, IndexUnavailable):
                    log.debug("disk tier view of %s: cannot read the index: %s", self.prefix, exc)
                self._ok = False
                self._generation = -1  # reload once the index can be read again
            self._seen_local = local
            self._next_poll = now + self.refresh_s

    def _say_log_off(self) -> None:
        """A WARNING the first time (once per view: old and new processes may take turns
        dropping and restoring the triggers), DEBUG after."""
        if self._log_off_said:
            log.debug("disk tier view of %s: the index's change log is off", self.prefix)
        else:
            self._log_off_said = True
            log.warning(
                "disk tier view of %s: the index's change log is off (an older version of "
                "the disk backend shares this directory and dropped its triggers); lookups "
                "check the files until a newer process's audit restores it",
                self.prefix,
            )

    def _poll(self, check: bool) -> None:
        self.polls += 1
        generation, version = self.index.view_version(check)
        if self._ok and generation == self._generation and version == self._version:
            return
        with self.index.view_snapshot() as tx:
            epoch = tx.change_log_epoch()
            if epoch is None:
                self._say_log_off()
                raise ChangeLogOff("the index's change log is off")
            if self._ok and generation == self._generation and epoch == self._epoch:
                delta = tx.changes_since(self._seq)
                if delta is not None:
                    _floor, last, rows = delta
                    names = self._names
                    n = len(self.prefix)
                    for path, present in rows:
                        if path.startswith(self.prefix) and is_object_relpath(path):
                            if present:
                                names.add(path[n:])
                            else:
                                names.discard(path[n:])
                    self._seq = last
                    self._version = version
                    self.updates += 1
                    return
            # first time, another index file, or pruned past what this view has seen
            last = tx.last_change()
            n = len(self.prefix)
            fresh = {p[n:] for p in tx.paths_under(self.prefix) if is_object_relpath(p)}
        self._names = fresh
        self._seq = last
        self._epoch = epoch
        self._generation = generation
        self._version = version
        self._ok = True
        self.reloads += 1
