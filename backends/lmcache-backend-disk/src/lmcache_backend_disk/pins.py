"""Cross-process pins of the disk backend (the tier pin protocol of the hierarchy's leases).

``pin_many(keys)`` records one row per stored key in the shared index's ``pins`` table, in
one ``BEGIN IMMEDIATE`` transaction; every process's eviction runs in such a transaction
too and skips entries with an unexpired pin, so a pin is honoured everywhere as soon as
``pin_many`` returns. A pin carries an expiry on the wall clock (``pin_seconds``, or
``ttl_s``), and the pins of a dead process go when its owner is reaped, so neither a hung
nor a crashed process can pin forever.

The calls are synchronous and meant for the event loop thread: they wait at most
:data:`PIN_WAIT_S` for the index (a pin that cannot be taken in time is ``None``, which
the hierarchy treats as "not pinned"; an unpin that cannot run in time is retried with the
next index transaction, and expires anyway).
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from lmcache_core.keys import CacheEngineKey

from .index import MAX_PIN_S, IndexTx
from .state import DiskState

__all__ = ["PIN_WAIT_S", "DiskPin", "DiskPins"]

log = logging.getLogger("lmcache_core.disk")

#: Longest wait for the index's lock in a pin or unpin call (seconds).
PIN_WAIT_S = 0.1
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class DiskPin:
    """A pin handle: the pin row's id, the object it pins, and the backend that took it."""

    id: int
    location: str
    owner: str
    expires: float


class DiskPins(DiskState):
    """``pin``/``unpin``/``pin_many``/``unpin_many`` for the disk backend (a mixin)."""

    #: Pins and unpins are index write transactions (waiting up to :data:`PIN_WAIT_S` for
    #: the lock): callers that must not stall release on the event loop (see
    #: ``TieredHierarchy.try_release_threadsafe``).
    pins_do_io = True
    _unpin_later: list[int]
    _unpin_lock: threading.Lock

    def pin(self, key: CacheEngineKey, ttl_s: float | None = None) -> DiskPin | None:
        """Keep the entry of ``key`` from eviction in every process sharing the directory,
        for ``ttl_s`` seconds (default ``pin_seconds``) or until :meth:`unpin`.

        ``None`` when ``key`` is not stored (or the index could not be reached in time).
        Pins nest. A pinned entry can still be removed or overwritten explicitly."""
        return self.pin_many([key], ttl_s)[0]

    def pin_many(
        self, keys: Sequence[CacheEngineKey], ttl_s: float | None = None
    ) -> list[DiskPin | None]:
        """:meth:`pin` for each key, in one index transaction."""
        if not keys:
            return []
        if not self.started:
            return [None] * len(keys)
        ttl = self.opts.pin_seconds if ttl_s is None else float(ttl_s)
        if not (0 < ttl <= MAX_PIN_S and math.isfinite(ttl)):
            raise ValueError(f"ttl_s must be in (0, {MAX_PIN_S:g}] seconds, got {ttl_s!r}")
        rels = [self._rel(k) for k in keys]
        now = time.time()
        expires = now + ttl
        try:
            ids = self._pin_tx(lambda tx: tx.add_pins(self.owner, rels, expires, now))
        except sqlite3.Error as exc:
            self.counters.pin_failures += 1
            log.debug("disk tier %s: pinning failed: %s", self.root, exc)
            return [None] * len(keys)
        out: list[DiskPin | None] = []
        for rel, pin_id in zip(rels, ids, strict=True):
            out.append(None if pin_id is None else DiskPin(pin_id, rel, self.owner, expires))
        self.counters.pins += sum(p is not None for p in out)
        return out

    def unpin(self, handle: object) -> None:
        """Undo one :meth:`pin` (``handle`` is what it returned)."""
        self.unpin_many([handle])

    def unpin_many(self, handles: Sequence[object]) -> None:
        """:meth:`unpin` for each handle, in one index transaction."""
        ids = []
        for h in handles:
            if not isinstance(h, DiskPin) or h.owner != self.owner:
                raise TypeError(f"not a pin handle of this backend: {h!r}")
            ids.append(h.id)
        if not ids:
            return
        with self._unpin_lock:
            self._unpin_later.extend(ids)
        if not self.started:
            return
        try:
            self._pin_tx(lambda tx: None)
        except sqlite3.Error as exc:  # left queued: the next transaction retries
            log.debug("disk tier %s: unpinning deferred: %s", self.root, exc)

    def _pin_tx(self, fn: Callable[[IndexTx], T], wait: float | None = PIN_WAIT_S) -> T:
        """Run ``fn`` in an index transaction (waiting at most ``wait`` for the lock) that
        first deletes the queued unpins; they stay queued if the transaction fails."""
        ids = self._take_unpins()
        try:
            with self.index.transaction(wait=wait) as tx:
                if ids:
                    tx.delete_pins(ids)
                return fn(tx)
        except BaseException:
            self._requeue_unpins(ids)
            raise

    def _take_unpins(self) -> list[int]:
        """The queued unpins (to delete in the caller's transaction)."""
        with self._unpin_lock:
            ids, self._unpin_later = self._unpin_later, []
        return ids

    def _requeue_unpins(self, ids: list[int]) -> None:
        """Put back unpins whose transaction failed."""
        if ids:
            with self._unpin_lock:
                self._unpin_later.extend(ids)

    def _drop_own_pins_sync(self) -> None:
        """Delete every pin this backend holds (at close)."""
        self._take_unpins()
        try:
            with self.index.transaction() as tx:
                tx.delete_pins_of(self.owner)
        except sqlite3.Error as exc:
            log.warning("disk tier %s: could not drop its pins at close: %s", self.root, exc)
