"""The cost-aware policy as it was before its per-chunk state was merged into one record
per key (commit c5e502b): kept as the reference the rewritten
:class:`~lmcache_core.placement.CostAwarePolicy` must agree with, call for call
(``tests/test_placement_fastpath.py``)."""

# ruff: noqa
# mypy: ignore-errors
from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Hashable
from collections.abc import Set as AbstractSet

from lmcache_core.placement.base import ChunkInfo
from lmcache_core.placement.cost import PrefillCost

__all__ = ["ReferenceCostAwarePolicy"]

_RESCALE_AT = 1e200


class _History:
    """Learned state of one key (resident or remembered)."""

    __slots__ = ("children", "count", "wlong", "wshort")

    def __init__(self) -> None:
        self.wshort = 0.0  # sum of growth weights at access times (short memory)
        self.wlong = 0.0  # the same with the long memory
        self.count = 0  # accesses
        self.children = 0  # distinct children seen after this key


class ReferenceCostAwarePolicy:
    """Value-per-byte placement for one tier (see the module docstring).

    ``capacity_bytes``: the tier's size (admission only compares values when it is full).
    ``bandwidth``: bytes per second a hit loads from this tier; ``latency_s``: per load.
    ``half_life``: accesses after which an access counts half in the short memory
    (default: ``short_factor`` = 0.25 accesses per chunk of capacity, at least 32);
    the long memory's is ``long_factor`` (256) times longer. With ``adapt`` every
    ``judge_every``-th access (16) ranks the requested key's history against 8 keys
    sampled from the remembered ones under each memory; the difference of the two ranks
    is a vote (decaying by 0.998 a vote), and the memory in use switches when the votes
    for the other pass ``switch_at`` (8). The policy starts with the short memory.
    ``min_reuse``: accesses before a chunk's
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
        long_factor: float = 256.0,
        short_factor: float = 0.25,
        judge_every: int = 16,
        switch_at: float = 8.0,
    ) -> None:
        if capacity_bytes < 0 or bandwidth <= 0:
            raise ValueError("capacity_bytes must be >= 0 and bandwidth > 0")
        self.capacity_bytes = capacity_bytes
        self.cost = cost or PrefillCost()
        self.bandwidth = bandwidth
        self.latency_s = latency_s
        chunks = capacity_bytes // chunk_bytes_hint if chunk_bytes_hint > 0 else 0
        if half_life is None:
            half_life = max(32.0, short_factor * chunks)
        if half_life <= 0:
            raise ValueError(f"half_life must be > 0, got {half_life}")
        self.half_life = half_life
        self.long_half_life = half_life * long_factor
        self.min_reuse = min_reuse
        self._adapt = adapt
        self._step_s = math.exp(math.log(2.0) / half_life)
        self._step_l = math.exp(math.log(2.0) / self.long_half_life)
        self._growth_s = 1.0
        self._growth_l = 1.0
        self._growth = 1.0  # the growth of the memory in use
        self.long_memory = False
        self._vote = 0.0
        self._judge_every = judge_every
        self._switch_at = switch_at
        self._tick = 0
        self._rng = random.Random(0)
        self._hist_list: list[Hashable] = []
        self._hist_pos: dict[Hashable, int] = {}
        self._hist: OrderedDict[Hashable, _History] = OrderedDict()
        self._history_cap = history
        self._resident: dict[Hashable, ChunkInfo] = {}
        self._used = 0
        self._res_children: dict[Hashable, int] = {}
        self._rate: dict[Hashable, float] = {}  # net prefill seconds saved per byte
        self._rates_by_shape: dict[tuple[int, int, int], float] = {}
        self._heap: list[tuple[float, int, Hashable, float]] = []
        self._seq = 0
        # (since the deferred pushes of 2 December 2026, mirrored here on purpose: chunks
        # inserted since the latest access go onto the heap at the next access)
        self._pending: list[Hashable] = []
        self._pend: set[Hashable] = set()

    # ------------------------------------------------------------------ valuation
    def expected_hits(self, key: Hashable, info: ChunkInfo) -> float:
        """Own decayed access weight, or the parent's share when that is larger (in
        units of the current access weight: 1.0 = one access just now)."""
        return self._hits(self._hist.get(key), info, self.long_memory) / self._growth

    def value(self, key: Hashable, info: ChunkInfo) -> float:
        """Expected prefill seconds saved per byte, net of load time (decayed units)."""
        rate = self._rate.get(key)
        if rate is None:
            rate = self._net_rate(info)
        return rate * self.expected_hits(key, info)

    # ------------------------------------------------------------------ interface
    def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
        # (the hot path: locals instead of repeated attribute loads)
        if self._pending:
            self._flush()
        gs = self._growth_s * self._step_s
        gl = self._growth_l * self._step_l
        self._growth_s = gs
        self._growth_l = gl
        if gs > _RESCALE_AT:
            self._rescale()
            gs, gl = self._growth_s, self._growth_l
        self._growth = gl if self.long_memory else gs
        hist = self._hist
        h = hist.get(key)
        if self._adapt:
            tick = self._tick + 1
            if tick >= self._judge_every:
                self._tick = 0
                self._judge(h, info)
            else:
                self._tick = tick
        if h is None:
            h = hist[key] = _History()
            self._hist_pos[key] = len(self._hist_list)
            self._hist_list.append(key)
            if info.parent is not None:
                ph = hist.get(info.parent)
                if ph is not None:
                    ph.children += 1
            if len(hist) > self._history_cap:
                self._forget_one()
        else:
            hist.move_to_end(key)
        h.wshort += gs
        h.wlong += gl
        h.count += 1

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        if info.parent is not None and info.parent not in self._resident:
            return False  # unreachable behind a missing parent
        if self._used + info.nbytes <= self.capacity_bytes:
            return True
        victim = self.victim(frozenset({info.parent}) if info.parent is not None else frozenset())
        if victim is None:
            return False
        displaced = self._rate[victim] * self.expected_hits(victim, self._resident[victim])
        return self.value(key, info) > displaced

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        if key in self._resident:
            return
        self._resident[key] = info
        self._rate[key] = self._net_rate(info)
        self._used += info.nbytes
        if info.parent is not None:
            self._res_children[info.parent] = self._res_children.get(info.parent, 0) + 1
        self._pending.append(key)
        self._pend.add(key)

    def _flush(self) -> None:
        pending = self._pending
        self._pending = []
        for key in pending:
            if key in self._pend:
                self._pend.discard(key)
                if key in self._resident and key not in self._res_children:
                    self._push(key)

    def removed(self, key: Hashable) -> None:
        info = self._resident.pop(key, None)
        if info is None:
            return
        self._used -= info.nbytes
        del self._rate[key]
        parent = info.parent
        if parent is not None and parent in self._res_children:
            n = self._res_children[parent] - 1
            if n <= 0:
                del self._res_children[parent]
                if parent in self._resident and parent not in self._pend:
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
            if h is not None and (h.wlong if self.long_memory else h.wshort) != entry[3]:
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
        if found is None and self._pending:
            self._flush()
            return self.victim(exclude)
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
        h = self._hist.get(key)
        lm = self.long_memory
        own = (h.wlong if lm else h.wshort) if h is not None else 0.0
        return self._rate[key] * self._hits(h, self._resident[key], lm), own

    def _hits(self, h: _History | None, info: ChunkInfo, long_memory: bool) -> float:
        """Expected hits in growth units of one memory: own weight once reused, or the
        parent's weight over its fan-out when that is larger."""
        hits = 0.0
        if h is not None and h.count >= self.min_reuse:
            hits = h.wlong if long_memory else h.wshort
        if info.parent is not None:
            ph = self._hist.get(info.parent)
            if ph is not None and ph.children > 0:
                hits = max(hits, (ph.wlong if long_memory else ph.wshort) / ph.children)
        return hits

    def _judge(self, h: _History | None, info: ChunkInfo) -> None:
        """Which memory predicts requests better? The key requested now (its history
        before this access) is ranked against 8 keys sampled from all remembered ones
        (not only the resident ones, which the memory in use chose) under each memory;
        the memory that ranks requested keys higher earns votes (decaying), and the one
        in use switches when the other leads clearly."""
        res = self._hist_list
        if h is None or len(res) < 16:
            return
        ks, kl = h.wshort, h.wlong
        below_s = below_l = 0
        pick = self._rng.randrange
        hist = self._hist
        n = len(res)
        for _ in range(8):
            rh = hist.get(res[pick(n)])
            if rh is not None:
                below_s += rh.wshort < ks
                below_l += rh.wlong < kl
        self._vote = 0.998 * self._vote + (below_l - below_s) / 8.0
        if self._vote > self._switch_at and not self.long_memory:
            self._switch(True)
        elif self._vote < -self._switch_at and self.long_memory:
            self._switch(False)

    def _switch(self, long_memory: bool) -> None:
        self.long_memory = long_memory
        self._growth = self._growth_l if long_memory else self._growth_s
        self._rebuild()

    def _push(self, key: Hashable) -> None:
        # _score inlined (the hot path: one push per insertion, leaf and re-valuation)
        self._seq += 1
        lm = self.long_memory
        hist = self._hist
        h = hist.get(key)
        hits = own = 0.0
        if h is not None:
            own = h.wlong if lm else h.wshort
            if h.count >= self.min_reuse:
                hits = own
        parent = self._resident[key].parent
        if parent is not None:
            ph = hist.get(parent)
            if ph is not None and ph.children > 0:
                share = (ph.wlong if lm else ph.wshort) / ph.children
                if share > hits:
                    hits = share
        heap = self._heap
        heapq.heappush(heap, (self._rate[key] * hits, self._seq, key, own))
        if len(heap) > 4 * len(self._resident) + 1024:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = []
        for key in self._resident:
            if key not in self._res_children and key not in self._pend:
                self._seq += 1
                v, w = self._score(key)
                self._heap.append((v, self._seq, key, w))
        heapq.heapify(self._heap)

    def _rescale(self) -> None:
        gs, gl = self._growth_s, self._growth_l
        for h in self._hist.values():
            h.wshort /= gs
            h.wlong /= gl
        self._growth_s = self._growth_l = self._growth = 1.0
        self._rebuild()

    def _forget_one(self) -> None:
        for key in self._hist:
            if key not in self._resident:
                del self._hist[key]
                i = self._hist_pos.pop(key)
                last = self._hist_list.pop()
                if i < len(self._hist_list):
                    self._hist_list[i] = last
                    self._hist_pos[last] = i
                return
