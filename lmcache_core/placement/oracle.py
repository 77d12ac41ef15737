"""A clairvoyant reference: Belady's rule on prefix chains, for bounding what a policy
could gain on a trace (it reads the future, so it is not a policy a tier can run).

:class:`BeladyOracle` knows, at every access, when the same chunk is next requested. It
admits a chunk only if it will be requested again and its parent is resident, and evicts
the resident chunk whose next request is farthest away. With variable chunk costs this is
not exactly optimal, but close: ``lmcache-core simulate --oracle`` prints it beside the
policies as an upper reference (docs/placement.md, "How far from the best"), with
:class:`StaticOracle`, the best fixed content chosen with hindsight.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from collections.abc import Set as AbstractSet

from .base import ChunkInfo
from .simulator import SimConfig, chunk_chain
from .traces import Request

__all__ = ["BeladyOracle", "StaticOracle"]

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


class StaticOracle:
    """The best *fixed* content chosen with hindsight: a reference for stationary traces.

    Under independent requests from a fixed popularity (the RAG, system-prompt and mix
    families are drawn that way) the best an online policy can expect is a fixed content:
    the chunks with the highest probability x saving per byte (Aho, Denning and Ullman's
    A0 for unit sizes). This oracle knows more than the probabilities: the trace's own
    counts. It picks chunks by ``(requests - 1) x prefill seconds / bytes`` (each with the
    missing part of its prefix, whose chunks are requested at least as often), greedily
    until the tier is full, admits only those and never evicts. Not a bound (greedy
    packing, and a policy can gain from the timing of a finite trace), but on stationary
    traces it estimates what knowing the popularity in advance is worth.
    """

    name = "static"

    def __init__(self, trace: Sequence[Request], cfg: SimConfig) -> None:
        kv_bytes_per_token, capacity = cfg.kv_bytes_per_token, cfg.capacity_bytes
        count: dict[Hashable, int] = {}
        worth: dict[Hashable, float] = {}
        size: dict[Hashable, int] = {}
        parent: dict[Hashable, Hashable | None] = {}
        for r in trace:
            for key, info in chunk_chain(r, kv_bytes_per_token):
                count[key] = count.get(key, 0) + 1
                worth[key] = cfg.cost.chunk_seconds(info.start_token, info.tokens)
                size[key] = info.nbytes
                parent[key] = info.parent
        order = sorted(
            (k for k, n in count.items() if n > 1),
            key=lambda k: -(count[k] - 1) * worth[k] / max(size[k], 1),
        )
        keep: set[Hashable] = set()
        used = 0
        for key in order:
            bundle: list[Hashable] = []
            k: Hashable | None = key
            while k is not None and k not in keep:
                bundle.append(k)
                k = parent[k]
            nbytes = sum(size[x] for x in bundle)
            if used + nbytes <= capacity:
                keep.update(bundle)
                used += nbytes
        self.keep = frozenset(keep)

    def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
        pass

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        return key in self.keep

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        pass

    def removed(self, key: Hashable) -> None:
        pass

    def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
        return None  # the kept chunks fit: nothing is ever evicted
