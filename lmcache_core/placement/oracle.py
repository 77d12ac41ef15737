"""A clairvoyant reference: Belady's rule on prefix chains, for bounding what a policy
could gain on a trace (it reads the future, so it is not a policy a tier can run).

:class:`BeladyOracle` knows, at every access, when the same chunk is next requested. It
admits a chunk only if it will be requested again and its parent is resident, and evicts
the resident chunk whose next request is farthest away. With variable chunk costs this is
not exactly optimal, but close: ``lmcache-core simulate --oracle`` prints it beside the
policies as an upper reference (docs/placement.md, "How far from the best").
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from collections.abc import Set as AbstractSet

from .base import ChunkInfo
from .simulator import chunk_chain
from .traces import Request

__all__ = ["BeladyOracle"]

_NEVER = float("inf")


class BeladyOracle:
    """Farthest-next-request eviction over ``trace`` (replayed in the same order).

    Build one per replay: it follows the simulator's access order (every chunk of every
    request, in order) to know where in the trace it is.
    """

    name = "oracle"

    def __init__(self, trace: Sequence[Request], kv_bytes_per_token: int) -> None:
        seq = [k for r in trace for k, _ in chunk_chain(r, kv_bytes_per_token)]
        nxt: list[float] = [_NEVER] * len(seq)
        last: dict[Hashable, int] = {}
        for i in range(len(seq) - 1, -1, -1):
            nxt[i] = last.get(seq[i], _NEVER)
            last[seq[i]] = i
        self._seq = seq
        self._next = nxt
        self._i = 0
        self._next_use: dict[Hashable, float] = {}
        self._resident: set[Hashable] = set()
        self._heap: list[tuple[float, int, Hashable]] = []
        self._n = 0

    def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
        if self._i >= len(self._seq) or self._seq[self._i] != key:
            raise ValueError("BeladyOracle replayed out of its trace's order")
        self._next_use[key] = self._next[self._i]
        self._i += 1
        if key in self._resident:
            self._push(key)

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        if info.parent is not None and info.parent not in self._resident:
            return False
        return self._next_use.get(key, _NEVER) != _NEVER

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        self._resident.add(key)
        self._push(key)

    def removed(self, key: Hashable) -> None:
        self._resident.discard(key)

    def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
        heap = self._heap
        aside = []
        found: Hashable | None = None
        while heap:
            neg, _, key = heap[0]
            if key not in self._resident or -neg != self._next_use[key]:
                heapq.heappop(heap)  # gone, or requested since (a newer entry exists)
                continue
            if key in exclude:
                aside.append(heapq.heappop(heap))
                continue
            found = key
            break
        for entry in aside:
            heapq.heappush(heap, entry)
        return found

    def _push(self, key: Hashable) -> None:
        self._n += 1
        heapq.heappush(self._heap, (-self._next_use[key], self._n, key))
