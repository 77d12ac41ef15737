"""Bounded per-key memory: sighting counts (``admit_after``) and known-present sets."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

__all__ = ["BoundedKeySet", "SightingCounter"]


class SightingCounter:
    """Counts how often each key was seen, remembering at most ``capacity`` keys (LRU).

    ``admit(key)`` records one sighting and says whether the key has now been seen at
    least ``threshold`` times. With ``threshold == 1`` nothing is remembered.
    """

    def __init__(self, threshold: int, capacity: int = 65536) -> None:
        self.threshold = threshold
        self.capacity = capacity
        self._counts: OrderedDict[Hashable, int] = OrderedDict()

    def admit(self, key: Hashable) -> bool:
        if self.threshold <= 1:
            return True
        n = self._counts.pop(key, 0) + 1
        self._counts[key] = n
        if len(self._counts) > self.capacity:
            self._counts.popitem(last=False)
        return n >= self.threshold

    def forget(self, key: Hashable) -> None:
        self._counts.pop(key, None)

    def __len__(self) -> int:
        return len(self._counts)


class BoundedKeySet:
    """A set of at most ``capacity`` keys; the least recently added go first."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, key: Hashable) -> None:
        self._keys.pop(key, None)
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def discard(self, key: Hashable) -> None:
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
