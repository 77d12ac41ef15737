"""Baseline placement policies: LRU (today's behaviour), ARC and S3-FIFO.

Each serves one tier and follows :class:`~lmcache_core.placement.base.PlacementPolicy`.
All admit every chunk (their strength is the eviction order); sizes are counted in
chunks, so ARC and S3-FIFO take the tier's capacity in chunks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from collections.abc import Set as AbstractSet

from .base import ChunkInfo

__all__ = ["ARCPolicy", "LRUPolicy", "S3FIFOPolicy"]


def _first_not_in(queue: Iterable[Hashable], exclude: AbstractSet[Hashable]) -> Hashable | None:
    for key in queue:
        if key not in exclude:
            return key
    return None


class LRUPolicy:
    """Least recently used first: a hit moves a chunk to the back of the queue.

    This is what every tier does today (the ``cpu`` backend's order). A prompt's lookup
    touches its chunks front to back, so the *first* chunk of a chain is its least recent.
    """

    name = "lru"

    def __init__(self) -> None:
        self._queue: OrderedDict[Hashable, None] = OrderedDict()

    def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
        if hit and key in self._queue:
            self._queue.move_to_end(key)

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        return True

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        self._queue[key] = None
        self._queue.move_to_end(key)

    def removed(self, key: Hashable) -> None:
        self._queue.pop(key, None)

    def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
        return _first_not_in(self._queue, exclude)


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha, 2003) over ``capacity`` chunks.

    ``T1`` holds chunks seen once, ``T2`` chunks seen again; the ghost lists ``B1``/``B2``
    remember recently evicted keys and move the target size ``p`` of ``T1``: a miss found
    in ``B1`` grows it, one found in ``B2`` shrinks it.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ARC needs a capacity of at least 1 chunk, got {capacity}")
        self.capacity = capacity
        self.p = 0.0
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()
        self._last_miss_in_b2 = False

    def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)
        elif key in self.b1:
            self.p = min(float(self.capacity), self.p + max(len(self.b2) / len(self.b1), 1.0))
            self._last_miss_in_b2 = False
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self._last_miss_in_b2 = True

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        return True

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        if key in self.b1 or key in self.b2:
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None
        elif key not in self.t2:
            self.t1[key] = None

    def removed(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
            while len(self.b1) > self.capacity:
                self.b1.popitem(last=False)
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
            while len(self.b2) > self.capacity:
                self.b2.popitem(last=False)

    def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
        n1 = len(self.t1)
        from_t1 = n1 > 0 and (n1 > self.p or (self._last_miss_in_b2 and n1 == int(self.p)))
        first, second = (self.t1, self.t2) if from_t1 else (self.t2, self.t1)
        key = _first_not_in(first, exclude)
        return key if key is not None else _first_not_in(second, exclude)


class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO (10%) filters one-hit chunks.

    New chunks enter the small queue; leaving it, a chunk re-accessed since it entered
    moves to the main queue, others are evicted and remembered in a ghost queue (a ghost
    that comes back goes straight to main). Main is a FIFO with a 2-bit frequency: a chunk
    with frequency > 0 is reinserted with one less, instead of being evicted.
    """

    name = "s3fifo"

    def __init__(self, capacity: int, small_fraction: float = 0.1) -> None:
        if capacity < 1:
            raise ValueError(f"S3-FIFO needs a capacity of at least 1 chunk, got {capacity}")
        self.capacity = capacity
        self.small_target = max(1, int(capacity * small_fraction))
        self.small: OrderedDict[Hashable, None] = OrderedDict()
        self.main: OrderedDict[Hashable, None] = OrderedDict()
        self.ghost: OrderedDict[Hashable, None] = OrderedDict()
        self.freq: dict[Hashable, int] = {}

    def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
        if key in self.freq:
            self.freq[key] = min(self.freq[key] + 1, 3)

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        return True

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        if key in self.freq:
            return
        self.freq[key] = 0
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None

    def removed(self, key: Hashable) -> None:
        if self.freq.pop(key, None) is None:
            return
        if key in self.small:
            del self.small[key]
            self.ghost[key] = None
            while len(self.ghost) > self.capacity:
                self.ghost.popitem(last=False)
        else:
            self.main.pop(key, None)

    def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
        for _ in range(4 * (len(self.small) + len(self.main)) + 1):
            if self.small and (len(self.small) > self.small_target or not self.main):
                key = next(iter(self.small))
                if key in exclude:
                    self.small.move_to_end(key)
                elif self.freq[key] > 0:
                    del self.small[key]
                    self.main[key] = None
                    self.freq[key] = 0
                else:
                    return key
            elif self.main:
                key = next(iter(self.main))
                if key in exclude:
                    self.main.move_to_end(key)
                elif self.freq[key] > 0:
                    self.freq[key] -= 1
                    self.main.move_to_end(key)
                else:
                    return key
            else:
                return None
        key = _first_not_in(self.small, exclude)
        return key if key is not None else _first_not_in(self.main, exclude)
