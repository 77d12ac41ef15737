"""The cost-aware placement policy: keep the chunks whose hits save the most prefill.

A resident chunk's value per byte is::

    value(k) = expected_hits(k) * (prefill_seconds(k) - load_seconds(k)) / nbytes(k)

* ``expected_hits`` is learned online. Every access adds a weight that grows by 2 every
  ``half_life`` accesses (so older accesses count exponentially less, with no per-key
  decay work); a chunk's own history counts once it has been reused (``min_reuse``),
  and is blended with its prefix's: a chunk after a parent that has been followed by
  ``F`` distinct children is worth at least ``1/F`` of the parent's weight (a system
  prompt followed by unique questions gives its children little; a document's next
  chunk inherits nearly all).
* ``prefill_seconds`` comes from :class:`~lmcache_core.placement.cost.PrefillCost` at the
  chunk's position (later chunks cost more to recompute); ``load_seconds`` is the chunk's
  size over the tier's bandwidth plus its latency.
* Eviction takes the lowest value among **leaves**: a chunk whose child (chunk ``i+1`` of
  the same chain) is resident is never evicted before that child, because a lookup stops
  at the first miss and the child would be unreachable.
* Admission: a chunk is admitted only when its parent is resident in the tier (or it is
  a chain's first chunk) and, when the tier is full, its value beats the chunk it would
  displace (TinyLFU-style), so one-off scans do not flush reused prefixes.

Victims come from a heap with lazy re-valuation: values in growth units only rise with
accesses, so an access costs no heap work; an entry that surfaces with an out-of-date
weight is valued again and pushed back, one whose key left or has resident children is
dropped (a key is pushed again when its last resident child leaves).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable
from collections.abc import Set as AbstractSet

from .base import ChunkInfo
from .cost import PrefillCost

__all__ = ["CostAwarePolicy"]

_RESCALE_AT = 1e200


class _History:
    """Learned state of one key (resident or remembered)."""

    __slots__ = ("children", "count", "weight")

    def __init__(self) -> None:
        self.weight = 0.0  # sum of growth weights at access times
        self.count = 0  # accesses
        self.children = 0  # distinct children seen after this key


class CostAwarePolicy:
    """Value-per-byte placement for one tier (see the module docstring).

    ``capacity_bytes``: the tier's size (admission only compares values when it is full).
    ``bandwidth``: bytes per second a hit loads from this tier; ``latency_s``: per load.
    ``half_life``: accesses after which an access counts half, at the start (default: 2
    accesses per chunk of capacity); with ``adapt`` it then moves between 1/8 and 8 times
    that start, ARC-style: a miss on a key this policy recently evicted or refused after
    one access shortens it (recency was under-valued), one on a key seen more often
    lengthens it (frequency was under-valued). ``min_reuse``: accesses before a chunk's
    own history counts (default 2: the access that brings a chunk in is no evidence it
    will be reused; until then only its prefix's share counts). ``history``: keys
    remembered beyond the resident ones (their weight and fan-out).
    """

    name = "cost"

    def __init__(
        self,
        capacity_bytes: int,
        cost: PrefillCost | None = None,
        bandwidth: float = 10e9,
        latency_s: float = 0.0,
        half_life: float | None = None,
        history: int = 1 << 18,
        chunk_bytes_hint: int = 0,
        adapt: bool = True,
        min_reuse: int = 2,
    ) -> None:
        if capacity_bytes < 0 or bandwidth <= 0:
            raise ValueError("capacity_bytes must be >= 0 and bandwidth > 0")
        self.capacity_bytes = capacity_bytes
        self.cost = cost or PrefillCost()
        self.bandwidth = bandwidth
        self.latency_s = latency_s
        chunks = capacity_bytes // chunk_bytes_hint if chunk_bytes_hint > 0 else 0
        if half_life is None:
            half_life = max(64.0, 2.0 * chunks)
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.half_life = half_life
        self.min_reuse = min_reuse
        self._half_bounds = (half_life / 8.0, half_life * 8.0)
        self._adapt = adapt
        self._step = math.exp(math.log(2.0) / half_life)
        self._growth = 1.0
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()
        self._ghost_cap = max(64, chunks)
        self._hist: OrderedDict[Hashable, _History] = OrderedDict()
        self._history_cap = history
        self._resident: dict[Hashable, ChunkInfo] = {}
        self._used = 0
        self._res_children: dict[Hashable, int] = {}
        self._rate: dict[Hashable, float] = {}  # net prefill seconds saved per byte
        self._rates_by_shape: dict[tuple[int, int, int], float] = {}
        self._heap: list[tuple[float, int, Hashable, float]] = []
        self._seq = 0

    # ------------------------------------------------------------------ valuation
    def expected_hits(self, key: Hashable, info: ChunkInfo) -> float:
        """Own decayed access weight, or the parent's share when that is larger (in
        units of the current access weight: 1.0 = one access just now)."""
        h = self._hist.get(key)
        own = h.weight if h is not None and h.count >= self.min_reuse else 0.0
        if info.parent is not None:
            ph = self._hist.get(info.parent)
            if ph is not None and ph.children > 0:
                own = max(own, ph.weight / ph.children)
        return own / self._growth

    def value(self, key: Hashable, info: ChunkInfo) -> float:
        """Expected prefill seconds saved per byte, net of load time (decayed units)."""
        rate = self._rate.get(key)
        if rate is None:
            rate = self._net_rate(info)
        return rate * self.expected_hits(key, info)

    # ------------------------------------------------------------------ interface
    def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
        self._growth *= self._step
        if self._growth > _RESCALE_AT:
            self._rescale()
        if self._adapt and not hit and self._ghost:
            count = self._ghost.pop(key, None)
            if count is not None:
                self._set_half_life(self.half_life * (0.95 if count <= 2 else 1.05))
        h = self._hist.get(key)
        if h is None:
            h = self._hist[key] = _History()
            if info.parent is not None:
                ph = self._hist.get(info.parent)
                if ph is not None:
                    ph.children += 1
            if len(self._hist) > self._history_cap:
                self._forget_one()
        else:
            self._hist.move_to_end(key)
        h.weight += self._growth
        h.count += 1

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        if info.parent is not None and info.parent not in self._resident:
            return False  # unreachable behind a missing parent
        if self._used + info.nbytes <= self.capacity_bytes:
            return True
        victim = self.victim(frozenset({info.parent}) if info.parent is not None else frozenset())
        if victim is None:
            return False
        if self.value(key, info) > self._rate[victim] * self.expected_hits(
            victim, self._resident[victim]
        ):
            return True
        self._remember_ghost(key)
        return False

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        if key in self._resident:
            return
        self._resident[key] = info
        self._rate[key] = self._net_rate(info)
        self._used += info.nbytes
        if info.parent is not None:
            self._res_children[info.parent] = self._res_children.get(info.parent, 0) + 1
        self._push(key)

    def removed(self, key: Hashable) -> None:
        info = self._resident.pop(key, None)
        if info is None:
            return
        self._used -= info.nbytes
        del self._rate[key]
        self._remember_ghost(key)
        parent = info.parent
        if parent is not None and parent in self._res_children:
            n = self._res_children[parent] - 1
            if n <= 0:
                del self._res_children[parent]
                if parent in self._resident:
                    self._push(parent)  # a leaf again: evictable
            else:
                self._res_children[parent] = n

    def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
        heap = self._heap
        aside: list[tuple[float, int, Hashable, float]] = []
        found: Hashable | None = None
        hist = self._hist
        while heap:
            entry = heap[0]
            key = entry[2]
            if key not in self._rate or key in self._res_children:
                heapq.heappop(heap)  # gone, or not a leaf (pushed again when it is)
                continue
            h = hist.get(key)
            if h is not None and h.weight != entry[3]:
                heapq.heappop(heap)  # accessed since it was pushed: value it again
                self._push(key)
                heap = self._heap  # a push may have rebuilt the heap
                continue
            if key in exclude:
                aside.append(heapq.heappop(heap))
                continue
            found = key
            break
        for entry in aside:
            heapq.heappush(self._heap, entry)
        return found

    def info_of(self, key: Hashable) -> ChunkInfo | None:
        """The :class:`ChunkInfo` a resident key was inserted with."""
        return self._resident.get(key)

    # ------------------------------------------------------------------ internals
    def _net_rate(self, info: ChunkInfo) -> float:
        shape = (info.start_token, info.tokens, info.nbytes)
        rate = self._rates_by_shape.get(shape)
        if rate is None:
            saved = self.cost.chunk_seconds(info.start_token, info.tokens)
            net = saved - (info.nbytes / self.bandwidth + self.latency_s)
            rate = self._rates_by_shape[shape] = max(net, 0.0) / max(info.nbytes, 1)
            if len(self._rates_by_shape) > 1 << 16:
                self._rates_by_shape.clear()
        return rate

    def _score(self, key: Hashable) -> tuple[float, float]:
        """(value in growth units, which do not decay; the key's weight now)."""
        info = self._resident[key]
        h = self._hist.get(key)
        own = h.weight if h is not None else 0.0
        hits = own if h is not None and h.count >= self.min_reuse else 0.0
        if info.parent is not None:
            ph = self._hist.get(info.parent)
            if ph is not None and ph.children > 0:
                hits = max(hits, ph.weight / ph.children)
        return self._rate[key] * hits, own

    def _push(self, key: Hashable) -> None:
        self._seq += 1
        v, w = self._score(key)
        heapq.heappush(self._heap, (v, self._seq, key, w))
        if len(self._heap) > 4 * len(self._resident) + 1024:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = []
        for key in self._resident:
            if key not in self._res_children:
                self._seq += 1
                v, w = self._score(key)
                self._heap.append((v, self._seq, key, w))
        heapq.heapify(self._heap)

    def _set_half_life(self, half_life: float) -> None:
        lo, hi = self._half_bounds
        self.half_life = min(hi, max(lo, half_life))
        self._step = math.exp(math.log(2.0) / self.half_life)

    def _remember_ghost(self, key: Hashable) -> None:
        if not self._adapt:
            return
        h = self._hist.get(key)
        self._ghost[key] = h.count if h is not None else 0
        self._ghost.move_to_end(key)
        if len(self._ghost) > self._ghost_cap:
            self._ghost.popitem(last=False)

    def _rescale(self) -> None:
        g = self._growth
        for h in self._hist.values():
            h.weight /= g
        self._growth = 1.0
        self._rebuild()

    def _forget_one(self) -> None:
        for key in self._hist:
            if key not in self._resident:
                del self._hist[key]
                return
