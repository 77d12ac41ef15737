"""Pins taken by lookups: a chunk found by ``lookup_prefix(..., lease_s=...)`` stays pinned
in its tier until ``release`` or the lease expires, so eviction between lookup and load
cannot turn a promised hit into a miss."""

from __future__ import annotations

import time
from collections.abc import Iterable

from ..keys import CacheEngineKey

__all__ = ["LeaseTable"]


class LeaseTable:
    """Outstanding pins: per key, a list of ``(tier_index, expiry)`` (one per lookup)."""

    def __init__(self) -> None:
        self._leases: dict[CacheEngineKey, list[tuple[int, float]]] = {}
        self.granted = 0
        self.released = 0
        self.expired = 0

    def add(self, key: CacheEngineKey, tier: int, lease_s: float) -> None:
        self._leases.setdefault(key, []).append((tier, time.monotonic() + lease_s))
        self.granted += 1

    def release(self, keys: Iterable[CacheEngineKey]) -> list[tuple[CacheEngineKey, int]]:
        """Drop one lease per key (the oldest); return the pins to undo."""
        out: list[tuple[CacheEngineKey, int]] = []
        for key in keys:
            lst = self._leases.get(key)
            if not lst:
                continue
            tier, _ = lst.pop(0)
            if not lst:
                del self._leases[key]
            out.append((key, tier))
        self.released += len(out)
        return out

    def pop_expired(self, now: float | None = None) -> list[tuple[CacheEngineKey, int]]:
        """Drop every lease past its expiry; return the pins to undo."""
        now = time.monotonic() if now is None else now
        out: list[tuple[CacheEngineKey, int]] = []
        for key in list(self._leases):
            lst = self._leases[key]
            keep = [(t, e) for t, e in lst if e > now]
            out.extend((key, t) for t, e in lst if e <= now)
            if keep:
                self._leases[key] = keep
            else:
                del self._leases[key]
        self.expired += len(out)
        return out

    def pop_all(self) -> list[tuple[CacheEngineKey, int]]:
        out = [(k, t) for k, lst in self._leases.items() for t, _ in lst]
        self._leases.clear()
        return out

    def next_expiry(self) -> float | None:
        return min((e for lst in self._leases.values() for _, e in lst), default=None)

    def __len__(self) -> int:
        return sum(len(v) for v in self._leases.values())
