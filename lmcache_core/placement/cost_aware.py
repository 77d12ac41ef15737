"""The cost-aware placement policy: keep the chunks whose hits save the most prefill.

A resident chunk's value per byte is::

    value(k) = expected_hits(k) * (prefill_seconds(k) - load_seconds(k)) / nbytes(k)

* ``expected_hits`` is learned online. Every access adds a weight that grows by 2 every
  ``half_life`` accesses (so older accesses count exponentially less, with no per-key
  decay work). Two memories run side by side, a short one (recency: chats whose turns
  come back soon, then never) and a long one (frequency: stationary popularity, as in
  RAG); the policy values chunks with one of them and switches when the other has
  predicted requests clearly better (see ``CostAwarePolicy._judge``). A chunk's
  own history counts once it has been reused (``min_reuse``),
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
  displace (TinyLFU-style), so one-off scans do not flush reused prefixes. With the
  short memory, a victim is also held when its hit density at its age (learned from
  the reuse distances, per class of access count) is well above a newcomer's: when
  reuses come after a bounded wait (a chat's next turn), a chunk part of the way
  through its wait is worth more than one starting its own, and displacing it for each
  newcomer is LRU's thrashing on a loop larger than the tier.

Victims come from a heap with lazy re-valuation: values in growth units only rise with
accesses, so an access costs no heap work; an entry that surfaces with an out-of-date
weight is valued again and pushed back, one whose key left or has resident children is
dropped (a key is pushed again when its last resident child leaves). A chunk goes onto
the heap at the first lookup after its insertion, not at the insertion, and only if it
is still a leaf then: a prompt's missing chunks are stored in chain order, each one a
parent right after, and a chunk whose store is still in flight cannot be evicted anyway
(until that lookup it is a victim only when no other leaf is).

All of a key's state (its history, whether it is resident, its rate, its resident
children) lives in one record, found with one dictionary lookup per call; heap entries
and the sampling list hold the records themselves. :meth:`CostAwarePolicy.record_accesses`
and :meth:`CostAwarePolicy.victim_in` are the batched forms the hierarchy uses (one call
per lookup; one pass over the heap per eviction): they decide exactly as the per-chunk
calls would.
"""

from __future__ import annotations

import heapq
import math
import random
from bisect import bisect_left
from collections.abc import Container, Hashable, Sequence
from collections.abc import Set as AbstractSet
from itertools import accumulate

from .base import ChunkInfo
from .cost import PrefillCost

__all__ = ["CostAwarePolicy"]

_RESCALE_AT = 1e200
_REUSE_BINS = 4 * 64  # 4 per octave of reuse distance
_DENSITY_MASK = 1023  # hit densities are estimated every 1024 reuses
_DENSITY_MIN = 64  # reuses of a class in the window before its densities count
_INC_RESCALE = 2.0**512
# Reuse statistics are kept per class of a key's access count: 1, 2-3, 4-7, 8 or more.
_CLASSES_AT = 8
_LAST_CLASS = 3
_CLASS_OF = (0, 0, 1, 1, 2, 2, 2, 2)


def _reuse_bin(d: int) -> int:
    """Histogram bin of a reuse distance ``d`` >= 1: 4 bins per octave."""
    n = d.bit_length()
    return d if n <= 2 else 4 * (n - 2) + ((d >> (n - 3)) & 3)


def _bin_top(b: int) -> int:
    """The largest distance in bin ``b`` (the inverse of :func:`_reuse_bin`)."""
    if b < 4:
        return b
    n = b // 4 + 2
    return ((4 + (b & 3) + 1) << (n - 3)) - 1


_Entry = tuple[float, int, "_Rec", float]  # (value, push order, record, weight then)


class _Rec:
    """Everything the policy knows about one key.

    A record exists while its key is *known* (in the history: accessed and not forgotten),
    resident, or the parent of resident chunks. ``alive`` turns false when it is dropped;
    a heap entry holding a dropped record is resolved through its key."""

    __slots__ = (
        "alive",
        "children",
        "count",
        "hpos",
        "info",
        "key",
        "kids",
        "known",
        "opos",
        "pend",
        "prec",
        "rate",
        "stamp",
        "wlong",
        "wshort",
    )

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.wshort = 0.0  # sum of growth weights at access times (short memory)
        self.wlong = 0.0  # the same with the long memory
        self.count = 0  # accesses
        self.children = 0  # distinct children seen after this key
        self.known = False  # in the history
        self.hpos = -1  # index in the sampling list (known keys)
        self.opos = -1  # index of its latest entry in the access order (once kept)
        self.stamp = 0  # the access clock at its latest access
        self.info: ChunkInfo | None = None  # set while resident
        self.rate = 0.0  # net prefill seconds saved per byte (resident)
        self.kids = 0  # resident chunks whose parent this key is
        self.prec: _Rec | None = None  # the parent's record (resident keys)
        self.pend = False  # inserted since the latest lookup: not on the heap yet
        self.alive = True


class CostAwarePolicy:
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
    remembered beyond the resident ones (their weight and fan-out). ``hold``: with the
    short memory, refuse a newcomer whose admission would displace a chunk whose hit
    density at its age is more than ``hold_margin`` (2) times a newcomer's (learned
    from the reuse distances, which are recorded only while the short memory is in use:
    see :meth:`_estimate_densities`).
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
        hold: bool = True,
        hold_margin: float = 2.0,
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
        self._recs: dict[Hashable, _Rec] = {}
        self._hist_list: list[_Rec] = []  # the known records (sampled by _judge)
        # Which known key was accessed least recently (forgetting) comes from each
        # record's access stamp. The order is only kept as a list once the history is
        # full (first forgetting: sorted by stamp), lazily: a record's latest entry is at
        # its opos; older entries are skipped (and compacted away).
        self._clock = 0
        self._ordered = False
        self._order: list[_Rec | None] = []
        self._ohead = 0
        self._history_cap = history
        self._res: dict[_Rec, None] = {}  # resident records, in insertion order
        self._used = 0
        self._rates_by_shape: dict[tuple[int, int, int], float] = {}
        self._heap: list[_Entry] = []
        self._seq = 0
        # Chunks inserted since the latest lookup go onto the heap at the next lookup
        # (see _flush), not at insertion: most of them have a child inserted right after
        # (a prompt's missing chunks are stored in chain order), and a chunk still being
        # stored cannot be evicted anyway.
        self._pending: list[_Rec] = []
        # Holding (see _estimate_densities): per class of access count, a histogram of
        # reuse distances (accesses between two accesses of a key, 4 bins per octave) and
        # the accesses that started in the class, both halved after each estimate.
        if hold_margin <= 0:
            raise ValueError(f"hold_margin must be > 0, got {hold_margin}")
        self._hold = hold
        self.hold_margin = hold_margin
        self._reuse_hist = [[0.0] * _REUSE_BINS for _ in range(_LAST_CLASS + 1)]
        self._class_acc = [0.0] * (_LAST_CLASS + 1)
        self._reuses = 0
        self._inc = 1.0  # what one reuse or access adds (doubles at each estimate)
        # per class, the hit density per age bin (empty: not estimated)
        self._density: list[list[float]] = [[] for _ in range(_LAST_CLASS + 1)]

    # ------------------------------------------------------------------ valuation
    def expected_hits(self, key: Hashable, info: ChunkInfo) -> float:
        """Own decayed access weight, or the parent's share when that is larger (in
        units of the current access weight: 1.0 = one access just now)."""
        return self._hits(self._known(key), info, self.long_memory) / self._growth

    def value(self, key: Hashable, info: ChunkInfo) -> float:
        """Expected prefill seconds saved per byte, net of load time (decayed units)."""
        rec = self._recs.get(key)
        rate = rec.rate if rec is not None and rec.info is not None else self._net_rate(info)
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
        rec = self._recs.get(key)
        if self._adapt:
            tick = self._tick + 1
            if tick >= self._judge_every:
                self._tick = 0
                self._judge(rec if rec is not None and rec.known else None)
            else:
                self._tick = tick
        self._clock += 1
        if rec is None or not rec.known:
            rec = self._learn(key, rec, info.parent)
        else:
            if self._hold and not self.long_memory:
                self._reuse_hist[_CLASS_OF[rec.count] if rec.count < _CLASSES_AT else _LAST_CLASS][
                    _reuse_bin(self._clock - rec.stamp)
                ] += self._inc
                self._reuses += 1
                if not self._reuses & _DENSITY_MASK:
                    self._estimate_densities()
            if self._ordered:
                self._reorder(rec)
        rec.stamp = self._clock
        rec.wshort += gs
        rec.wlong += gl
        n = rec.count + 1
        rec.count = n
        if self._hold and not self.long_memory:
            self._class_acc[_CLASS_OF[n] if n < _CLASSES_AT else _LAST_CLASS] += self._inc

    def record_accesses(
        self, keys: Sequence[Hashable], infos: Sequence[ChunkInfo], hits: Sequence[bool]
    ) -> None:
        """:meth:`record_access` for each (key, info, hit) in order (one call per lookup;
        the same decisions as the per-chunk calls)."""
        del hits  # the policy learns from accesses, not from their outcome
        if self._pending:
            self._flush()
        recs = self._recs
        step_s, step_l = self._step_s, self._step_l
        rescale_at = _RESCALE_AT
        adapt, every = self._adapt, self._judge_every
        # The growths and the judging tick live in locals; they are written back before
        # anything that reads them (rescaling, judging) and at the end.
        gs, gl = self._growth_s, self._growth_l
        tick = self._tick
        clock = self._clock
        # (holding only matters with the short memory: no reuse statistics meanwhile)
        hold = self._hold and not self.long_memory
        rhist, racc = self._reuse_hist, self._class_acc
        reuses, inc = self._reuses, self._inc
        for key, info in zip(keys, infos, strict=True):
            gs *= step_s
            gl *= step_l
            clock += 1
            if gs > rescale_at:
                self._growth_s, self._growth_l = gs, gl
                self._rescale()
                gs, gl = self._growth_s, self._growth_l
            rec = recs.get(key)
            if adapt:
                tick += 1
                if tick >= every:
                    tick = 0
                    self._growth_s, self._growth_l = gs, gl
                    self._growth = gl if self.long_memory else gs
                    self._judge(rec if rec is not None and rec.known else None)
                    # (a vote may switch the memory: statistics stop or start here, as
                    # the per-chunk call would)
                    hold = self._hold and not self.long_memory
            if rec is None or not rec.known:
                self._clock = clock
                rec = self._learn(key, rec, info.parent)
            else:
                if hold:
                    d = clock - rec.stamp  # the reuse distance, binned as _reuse_bin does
                    nb = d.bit_length()
                    c = rec.count
                    rhist[_CLASS_OF[c] if c < _CLASSES_AT else _LAST_CLASS][
                        d if nb <= 2 else 4 * nb - 8 + ((d >> (nb - 3)) & 3)
                    ] += inc
                    reuses += 1
                    if not reuses & _DENSITY_MASK:
                        self._reuses = reuses
                        self._estimate_densities()
                        inc = self._inc
                if self._ordered:
                    self._reorder(rec)
            rec.stamp = clock
            rec.wshort += gs
            rec.wlong += gl
            n = rec.count + 1
            rec.count = n
            if hold:
                racc[_CLASS_OF[n] if n < _CLASSES_AT else _LAST_CLASS] += inc
        self._growth_s, self._growth_l = gs, gl
        self._growth = gl if self.long_memory else gs
        self._tick = tick
        self._clock = clock
        self._reuses = reuses

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        recs = self._recs
        skip: _Rec | None = None
        if info.parent is not None:
            skip = recs.get(info.parent)
            if skip is None or skip.info is None:
                return False  # unreachable behind a missing parent
        if self._used + info.nbytes <= self.capacity_bytes:
            return True
        victim = self._scan(None, skip, None, 0)
        if victim is None:
            return False
        lm = self.long_memory
        if not lm and self._hold and self._holds(victim, recs.get(key)):
            return False  # worth more than a newcomer at its age (_estimate_densities)
        growth = self._growth
        # (a resident record's prec is its parent's record; the newcomer's is ``skip``)
        displaced = victim.rate * (self._hits_of(victim, victim.prec, lm) / growth)
        rec = recs.get(key)
        rate = rec.rate if rec is not None and rec.info is not None else self._net_rate(info)
        mine = rate * (self._hits_of(rec, skip, lm) / growth)
        return mine > displaced

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        recs = self._recs
        rec = recs.get(key)
        if rec is None:
            rec = recs[key] = _Rec(key)
        elif rec.info is not None:
            return
        rec.info = info
        rate = self._rates_by_shape.get((info.start_token, info.tokens, info.nbytes))
        rec.rate = rate if rate is not None else self._net_rate(info)
        self._res[rec] = None
        self._used += info.nbytes
        parent = info.parent
        if parent is not None:
            prec = recs.get(parent)
            if prec is None:
                prec = recs[parent] = _Rec(parent)  # holds its resident children's count
            prec.kids += 1
            rec.prec = prec
        else:
            rec.prec = None
        # onto the heap at the next lookup, if it is a leaf then (_flush)
        rec.pend = True
        self._pending.append(rec)

    def removed(self, key: Hashable) -> None:
        rec = self._recs.get(key)
        if rec is None or rec.info is None:
            return
        info = rec.info
        rec.info = None
        del self._res[rec]
        self._used -= info.nbytes
        prec = rec.prec
        rec.prec = None
        if prec is not None and prec.kids > 0:
            n = prec.kids - 1
            prec.kids = n
            if n <= 0:
                if prec.info is not None:
                    if not prec.pend:  # (a pending one is pushed by _flush)
                        self._push(prec)  # a leaf again: evictable
                elif not prec.known:
                    self._drop_if_unused(prec)
        if not rec.known:
            self._drop_if_unused(rec)

    def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
        rec = self._scan(exclude if exclude else None, None, None, 0)
        return None if rec is None else rec.key

    def victim_in(self, allowed: Container[Hashable], limit: int = 64) -> Hashable | None:
        """The first key in eviction order that ``allowed`` contains, looking at no more
        than ``limit`` candidates: what asking :meth:`victim` again, excluding each named
        key that is not allowed, would find (one pass over the heap instead)."""
        rec = self._scan(None, None, allowed, limit)
        return None if rec is None else rec.key

    def access_count(self, key: Hashable) -> int:
        """How many accesses of ``key`` the history holds (0: none remembered)."""
        rec = self._known(key)
        return 0 if rec is None else rec.count

    def info_of(self, key: Hashable) -> ChunkInfo | None:
        """The :class:`ChunkInfo` a resident key was inserted with."""
        rec = self._recs.get(key)
        return None if rec is None else rec.info

    # ------------------------------------------------------------------ internals
    def _known(self, key: Hashable) -> _Rec | None:
        rec = self._recs.get(key)
        return rec if rec is not None and rec.known else None

    def _learn(self, key: Hashable, rec: _Rec | None, parent: Hashable | None) -> _Rec:
        """A first access (or the first since it was forgotten): ``key`` joins the history."""
        recs = self._recs
        if rec is None:
            rec = recs[key] = _Rec(key)
        rec.known = True
        rec.hpos = len(self._hist_list)
        self._hist_list.append(rec)
        rec.stamp = self._clock
        if self._ordered:
            rec.opos = len(self._order)
            self._order.append(rec)
        if parent is not None:
            prec = recs.get(parent)
            if prec is not None and prec.known:
                prec.children += 1
        if len(self._hist_list) > self._history_cap:
            self._forget_one()
        return rec

    def _scan(
        self,
        exclude: AbstractSet[Hashable] | None,
        skip: _Rec | None,
        allowed: Container[Hashable] | None,
        limit: int,
    ) -> _Rec | None:
        """The lowest-valued resident leaf not in ``exclude``, not ``skip`` and (with
        ``allowed``) in ``allowed``, among the first ``limit`` valid candidates (0: all).
        Out-of-date entries are dropped or valued again on the way, as one :meth:`victim`
        call after another would."""
        heap = self._heap
        aside: list[_Entry] = []
        found: _Rec | None = None
        lm = self.long_memory
        pop = heapq.heappop
        looked = 0
        seen: set[Hashable] | None = None  # keys named and refused (``allowed`` only)
        while heap:
            entry = heap[0]
            rec = entry[2]
            if not rec.alive:  # dropped since: the key's current record, if any
                cur = self._recs.get(rec.key)
                if cur is None:
                    pop(heap)
                    continue
                rec = cur
            if rec.info is None or rec.kids:
                pop(heap)  # gone, or not a leaf (pushed again when it is)
                continue
            if rec.known and (rec.wlong if lm else rec.wshort) != entry[3]:
                pop(heap)  # accessed since it was pushed: value it again
                self._push(rec)
                heap = self._heap  # a push may have rebuilt the heap
                lm = self.long_memory
                continue
            if rec is skip or (exclude is not None and rec.key in exclude):
                aside.append(pop(heap))
                continue
            if allowed is not None:
                key = rec.key
                if seen is not None and key in seen:
                    aside.append(pop(heap))  # another entry of a key already refused
                    continue
                if key not in allowed:
                    looked += 1
                    if looked >= limit:
                        break
                    if seen is None:
                        seen = set()
                    seen.add(key)
                    aside.append(pop(heap))
                    continue
            found = rec
            break
        for e in aside:
            heapq.heappush(self._heap, e)
        if found is None and self._pending:  # only chunks inserted since the last lookup
            self._flush()
            return self._scan(exclude, skip, allowed, limit)
        return found

    def _flush(self) -> None:
        """The chunks inserted since the latest lookup go onto the heap, those that are
        still resident leaves (in insertion order, valued as at their insertion: no
        access has changed a weight since)."""
        pending = self._pending
        self._pending = []
        for rec in pending:
            if rec.pend:
                rec.pend = False
                if rec.info is not None and not rec.kids:
                    self._push(rec)

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

    def _score(self, rec: _Rec) -> tuple[float, float]:
        """(value in growth units, which do not decay; the key's weight now)."""
        lm = self.long_memory
        own = (rec.wlong if lm else rec.wshort) if rec.known else 0.0
        info = rec.info
        assert info is not None
        return rec.rate * self._hits(rec if rec.known else None, info, lm), own

    def _hits(self, h: _Rec | None, info: ChunkInfo, long_memory: bool) -> float:
        """Expected hits in growth units of one memory: own weight once reused, or the
        parent's weight over its fan-out when that is larger."""
        hits = 0.0
        if h is not None and h.count >= self.min_reuse:
            hits = h.wlong if long_memory else h.wshort
        if info.parent is not None:
            ph = self._recs.get(info.parent)
            if ph is not None and ph.known and ph.children > 0:
                hits = max(hits, (ph.wlong if long_memory else ph.wshort) / ph.children)
        return hits

    def _hits_of(self, h: _Rec | None, ph: _Rec | None, long_memory: bool) -> float:
        """:meth:`_hits` with the parent's record at hand (``None``: no parent, or one
        with no record)."""
        hits = 0.0
        if h is not None and h.known and h.count >= self.min_reuse:
            hits = h.wlong if long_memory else h.wshort
        if ph is not None and ph.known and ph.children > 0:
            hits = max(hits, (ph.wlong if long_memory else ph.wshort) / ph.children)
        return hits

    def _judge(self, h: _Rec | None) -> None:
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
        # randrange(n), inlined (the same draws: what random.Random._randbelow does)
        bits = self._rng.getrandbits
        n = len(res)
        k = n.bit_length()
        for _ in range(8):
            i = bits(k)
            while i >= n:
                i = bits(k)
            rh = res[i]
            below_s += rh.wshort < ks
            below_l += rh.wlong < kl
        self._vote = 0.998 * self._vote + (below_l - below_s) / 8.0
        if self._vote > self._switch_at and not self.long_memory:
            self._switch(True)
        elif self._vote < -self._switch_at and self.long_memory:
            self._switch(False)

    def _estimate_densities(self) -> None:
        """Which ages make a resident chunk worth holding against a newcomer (see
        :meth:`admit`), from the recent reuse distances (the histogram halves after each
        estimate, so it follows the trace).

        The short memory values a chunk by how recently it was accessed, as if its next
        access were as likely soon as late (memoryless). When reuses come after a
        bounded wait instead (a chat's next turn, seconds to a minute later), a chunk
        part of the way through its wait has *less* of it left than a newcomer starting
        its own: it is worth more per byte held, not less, and displacing it for each
        newcomer is LRU's thrashing on a loop larger than the tier. The measure is the
        hit density of an access at age ``a`` (accesses since its latest):
        ``P(reused | not yet by a) / E[accesses still held | a]`` (Beckmann et al.'s
        LHD, NSDI 2018), where a reuse ends the holding at its distance and an access
        never reused (the accesses beyond the reuses) is held to the horizon, the
        distance within which 99% of reuses happen. Reuses are counted per class of a
        key's access count (1, 2-3, 4-7, 8 or more: a chat's chunks are not a system
        prompt's). A victim whose density at its age is more than ``hold_margin`` times
        a newcomer's (age 0, the newcomer's class) is held; beyond the horizon none is.
        With memoryless or heavy-tailed reuse distances (stationary popularity: RAG,
        system prompts) the density does not rise with age, and nothing is held. The
        margin (2) keeps estimation noise from holding: with 1, multi-turn at 25% of
        its working set lost up to 3.4% against LRU (seeds 2 and 3)."""
        self._density = [self._densities(c) for c in range(_LAST_CLASS + 1)]
        # Halving every count is doubling the next increments (exactly: powers of 2),
        # with no pass over the bins; they are scaled down once the increment is large.
        inc = self._inc * 2.0
        if inc > _INC_RESCALE:
            for hist in self._reuse_hist:
                hist[:] = [x / _INC_RESCALE for x in hist]
            acc = self._class_acc
            acc[:] = [x / _INC_RESCALE for x in acc]
            inc /= _INC_RESCALE
        self._inc = inc

    def _holds(self, victim: _Rec, rec: _Rec | None) -> bool:
        """Whether ``victim``'s hit density at its age beats a newcomer's (``rec``: its
        record, whose latest access was just now)."""
        n = rec.count if rec is not None else 1
        fresh = self._density[_CLASS_OF[n] if n < _CLASSES_AT else _LAST_CLASS]
        if not fresh:
            return False
        n = victim.count
        mine = self._density[_CLASS_OF[n] if n < _CLASSES_AT else _LAST_CLASS]
        b = _reuse_bin(self._clock - victim.stamp)
        return b < len(mine) and mine[b] > self.hold_margin * fresh[0]

    def _densities(self, c: int) -> list[float]:
        """Hit density per age bin of class ``c`` (empty: too few reuses)."""
        hist = self._reuse_hist[c]
        total = sum(hist)
        if total < _DENSITY_MIN * self._inc:
            return []
        # The horizon: the bin in which 99% of the reuses are reached.
        top = min(bisect_left(list(accumulate(hist)), 0.99 * total), len(hist) - 1)
        horizon = _bin_top(top) + 1
        never = max(self._class_acc[c] - total, 0.0)
        # Walk the bins down from the horizon: reuses at or after the bin's start and
        # the accesses they hold from there on (bin midpoints).
        hits = held = 0.0
        density = [0.0] * (top + 1)
        for b in range(top, -1, -1):
            lo = _bin_top(b - 1) + 1 if b else 0
            hits += hist[b]
            held += hist[b] * 0.5 * (lo + _bin_top(b))
            life = held - hits * lo + never * (horizon - lo)
            density[b] = hits / life if life > 0.0 else 0.0
        return density

    def _switch(self, long_memory: bool) -> None:
        self.long_memory = long_memory
        self._growth = self._growth_l if long_memory else self._growth_s
        self._rebuild()

    def _push(self, rec: _Rec) -> None:
        # _score inlined (the hot path: one push per insertion, leaf and re-valuation)
        self._seq += 1
        lm = self.long_memory
        hits = own = 0.0
        if rec.known:
            own = rec.wlong if lm else rec.wshort
            if rec.count >= self.min_reuse:
                hits = own
        ph = rec.prec
        if ph is not None and ph.known and ph.children > 0:
            share = (ph.wlong if lm else ph.wshort) / ph.children
            if share > hits:
                hits = share
        heap = self._heap
        heapq.heappush(heap, (rec.rate * hits, self._seq, rec, own))
        if len(heap) > 4 * len(self._res) + 1024:
            self._rebuild()

    def _rebuild(self) -> None:
        heap: list[_Entry] = []
        for rec in self._res:
            if not rec.kids and not rec.pend:
                self._seq += 1
                v, w = self._score(rec)
                heap.append((v, self._seq, rec, w))
        heapq.heapify(heap)
        self._heap = heap

    def _rescale(self) -> None:
        gs, gl = self._growth_s, self._growth_l
        for h in self._hist_list:
            h.wshort /= gs
            h.wlong /= gl
        self._growth_s = self._growth_l = self._growth = 1.0
        self._rebuild()

    def _drop_if_unused(self, rec: _Rec) -> None:
        if not rec.known and rec.info is None and not rec.kids and rec.alive:
            rec.alive = False
            if self._recs.get(rec.key) is rec:
                del self._recs[rec.key]

    def _reorder(self, rec: _Rec) -> None:
        """``rec`` was accessed: its entry moves to the end of the kept order."""
        order = self._order
        order[rec.opos] = None
        rec.opos = len(order)
        order.append(rec)
        if len(order) > 2 * len(self._hist_list) + 4096:
            self._compact_order()

    def _compact_order(self) -> None:
        order: list[_Rec | None] = []
        for rec in self._order[self._ohead :]:
            if rec is not None:
                rec.opos = len(order)
                order.append(rec)
        self._order = order
        self._ohead = 0

    def _forget_one(self) -> None:
        """Forget the least recently accessed key that is not resident."""
        if not self._ordered:  # the first time: the order from the access stamps
            self._ordered = True
            ranked = sorted(self._hist_list, key=lambda r: r.stamp)
            for i, r in enumerate(ranked):
                r.opos = i
            self._order = list(ranked)
            self._ohead = 0
        order = self._order
        i = self._ohead
        n = len(order)
        while i < n and order[i] is None:
            i += 1
        self._ohead = i
        while i < n:
            rec = order[i]
            if rec is not None and rec.info is None:
                order[i] = None
                rec.opos = -1
                rec.known = False
                rec.wshort = rec.wlong = 0.0
                rec.count = rec.children = 0
                last = self._hist_list.pop()
                if last is not rec:
                    self._hist_list[rec.hpos] = last
                    last.hpos = rec.hpos
                rec.hpos = -1
                self._drop_if_unused(rec)
                return
            i += 1
