"""Pins taken by lookups: a chunk found by ``lookup_prefix(..., lease_s=...)`` stays pinned
in its tier until ``release`` or the lease expires, so eviction between lookup and load
cannot turn a promised hit into a miss.

A tier that can pin provides ``pin(key) -> handle | None`` and ``unpin(handle)``; the
table keeps the handles.

Leases are anonymous: ``release(keys)`` ends one lease per key, not a given caller's. When
several leases on one key are outstanding they may hold different entries (the key was
overwritten between two lookups, or found in different tiers), and ending the wrong one
would leave a caller's promised hit unpinned. So a key's leases are kept in release order:
deepest tier first, then the oldest entry (a handle's ``pin_order``, an integer a tier
may give its handles that grows with each entry it stores). What stays pinned is then
always the newest entry in the highest tier, which every holder's top-down load finds. The table is safe to use from any thread (the hierarchy takes
and ends leases from its callers' threads on its thread-safe fast path, and expires them
on its event loop): every method runs under one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ..keys import CacheEngineKey

__all__ = ["Lease", "LeaseTable"]

#: One lease: (tier index, expiry on the monotonic clock, the tier's pin handle).
Lease = tuple[int, float, object]


def _release_rank(lease: Lease) -> tuple[int, int]:
    return (-lease[0], getattr(lease[2], "pin_order", 0))


class LeaseTable:
    """Outstanding leases: per key, a list of :data:`Lease` (one per lookup)."""

    def __init__(self) -> None:
        self._leases: dict[CacheEngineKey, list[Lease]] = {}
        self._lock = threading.Lock()
        self._count = 0
        self._armed = False
        self.granted = 0
        self.released = 0
        self.expired = 0

    def add(self, key: CacheEngineKey, lease: Lease) -> None:
        with self._lock:
            self._add(key, lease)

    def _add(self, key: CacheEngineKey, lease: Lease) -> None:
        lst = self._leases.get(key)
        if lst is None:
            self._leases[key] = [lease]
        else:
            # keep release order (see the module docstring): after every lease that is to
            # end before this one
            rank = _release_rank(lease)
            pos = len(lst)
            while pos and _release_rank(lst[pos - 1]) > rank:
                pos -= 1
            lst.insert(pos, lease)
        self._count += 1
        self.granted += 1

    def add_many(self, items: Iterable[tuple[CacheEngineKey, Lease]]) -> bool:
        """Add leases; ``True`` when the expiry sweeper is not running and must be started
        (see :meth:`next_expiry_or_disarm`). The answer is ``True`` once per disarm."""
        with self._lock:
            for key, lease in items:
                self._add(key, lease)
            if self._armed or not self._count:
                return False
            self._armed = True
            return True

    def release(self, keys: Iterable[CacheEngineKey]) -> list[Lease]:
        """Drop one lease per key (the first in release order: deepest tier, then oldest
        entry); return them (their pins are to be undone)."""
        out: list[Lease] = []
        with self._lock:
            leases = self._leases
            for key in keys:
                lst = leases.get(key)
                if lst is None:
                    continue
                out.append(lst.pop(0))
                if not lst:
                    del leases[key]
            self._count -= len(out)
            self.released += len(out)
        return out

    def pop_expired(self, now: float) -> list[Lease]:
        """Drop every lease past its expiry and return them."""
        out: list[Lease] = []
        with self._lock:
            for key in list(self._leases):
                lst = self._leases[key]
                keep = [le for le in lst if le[1] > now]
                if len(keep) != len(lst):
                    out.extend(le for le in lst if le[1] <= now)
                    if keep:
                        self._leases[key] = keep
                    else:
                        del self._leases[key]
            self._count -= len(out)
            self.expired += len(out)
        return out

    def pop_all(self) -> list[Lease]:
        with self._lock:
            out = [le for lst in self._leases.values() for le in lst]
            self._leases.clear()
            self._count = 0
        return out

    def next_expiry(self) -> float | None:
        with self._lock:
            return self._next_expiry()

    def _next_expiry(self) -> float | None:
        return min((le[1] for lst in self._leases.values() for le in lst), default=None)

    def arm(self) -> None:
        """Record that the expiry sweeper runs (started by the event loop itself)."""
        with self._lock:
            self._armed = True

    def next_expiry_or_disarm(self) -> float | None:
        """The next expiry; ``None`` when no lease is left, in which case the sweeper is
        recorded as stopped, atomically with the check (a lease added afterwards by
        :meth:`add_many` reports that the sweeper must be started again)."""
        with self._lock:
            nxt = self._next_expiry()
            if nxt is None:
                self._armed = False
            return nxt

    def __len__(self) -> int:
        return self._count
