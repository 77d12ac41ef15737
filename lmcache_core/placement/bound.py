"""An upper bound on the prefill compute any placement policy can save on a trace.

``lmcache-core simulate --bound`` prints it beside the policies: if even this bound is
less than 10% above the best baseline, no policy (online or clairvoyant) can beat that
baseline by 10% on the trace and tier size (docs/placement.md, "How far from the best").

**The relaxation.** Number the requests ``0..R-1`` and call *boundary* ``t`` the moment
between request ``t`` and ``t + 1``. A chunk requested by request ``a`` and next by
request ``b`` can only be a hit at ``b`` if it is resident at every boundary
``a..b-1`` (it cannot enter the tier between its requests). Each such pair is an
*interval* ``I`` with weight ``w_I`` (the prefill seconds a hit at ``b`` saves:
``PrefillCost.chunk_seconds`` at the chunk's position) and size ``s_I`` (its bytes).
Any policy's hits give ``x_I`` in {0, 1} with

* capacity: at every boundary ``t``, ``sum(s_I * x_I for I covering t) <= C``;
* chains: a hit needs the previous chunk of its prompt to hit in the same request, so
  ``x_I <= x_parent(I)`` (the parent's interval ending at the same request: every request
  with a chunk also has its parent, so that interval exists);

and saves ``sum(w_I * x_I)``. Allowing ``x_I`` anywhere in [0, 1] only enlarges the set,
so the maximum of this linear program bounds every policy. **The bound** is its
Lagrangian dual: for any prices ``lam_t >= 0`` (per byte held over boundary ``t``) and
``nu_I >= 0`` (per chain constraint),

    L(lam, nu) = C * sum(lam) + sum(max(0, w_I - nu_I + sum(nu_c for children c of I)
                                         - s_I * sum(lam_t for t in I)))

is at least ``sum(w_I * x_I)`` for every feasible ``x`` (weak duality), so **every**
``L`` evaluated is a valid bound: a poor choice of prices gives a looser bound, never a
wrong one. The prices start from the best uniform price (golden-section search) and are
improved by projected subgradient steps (Polyak's rule towards ``target``, a value some
policy achieved); the smallest ``L`` seen is returned. Compulsory misses (first requests)
and chunks never requested again form no interval: they save nothing in any policy.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from .simulator import SimConfig, chunk_chain
from .traces import Request

__all__ = ["Bound", "prefill_bound"]


@dataclass(frozen=True)
class Bound:
    """An upper bound on the prefill seconds a tier of ``capacity_bytes`` can save.

    ``seconds``: the bound; ``uniform_seconds``: the bound at the best uniform price (the
    starting point); ``intervals``: reuse intervals; ``iterations``: subgradient steps
    run; ``no_capacity_seconds``: what an unbounded tier would save (every reuse a hit)."""

    capacity_bytes: int
    seconds: float
    uniform_seconds: float
    no_capacity_seconds: float
    intervals: int
    iterations: int


class _Intervals:
    """The reuse intervals of a trace (see the module docstring), as arrays."""

    def __init__(self, trace: Sequence[Request], cfg: SimConfig) -> None:
        last: dict[Hashable, tuple[int, int]] = {}  # key -> (request, its latest interval)
        a: list[int] = []
        b: list[int] = []
        w: list[float] = []
        s: list[float] = []
        parent: list[int] = []
        cost = cfg.cost
        for r, req in enumerate(trace):
            here: dict[Hashable, int] = {}  # this request's intervals by key
            for key, info in chunk_chain(req, cfg.kv_bytes_per_token):
                prev = last.get(key)
                idx = -1
                if prev is not None:
                    idx = len(a)
                    a.append(prev[0])
                    b.append(r)
                    w.append(cost.chunk_seconds(info.start_token, info.tokens))
                    s.append(float(info.nbytes))
                    p = here.get(info.parent, -2) if info.parent is not None else -1
                    # -2: the parent has no interval ending here (its first request): the
                    # chunk cannot hit; its weight is zeroed below
                    parent.append(p)
                here[key] = idx if idx >= 0 else -2
                last[key] = (r, idx)
        self.requests = len(trace)
        self.a = np.asarray(a, dtype=np.int64)
        self.b = np.asarray(b, dtype=np.int64)
        self.w = np.asarray(w, dtype=np.float64)
        self.s = np.asarray(s, dtype=np.float64)
        self.parent = np.asarray(parent, dtype=np.int64)
        # a chunk whose parent cannot hit cannot hit either (transitively, along chains:
        # parents come first in a request, so one pass in order settles it)
        ok = np.ones(len(a), dtype=bool)
        for i, p in enumerate(parent):
            if p == -2 or (p >= 0 and not ok[p]):
                ok[i] = False
        self.w = np.where(ok, self.w, 0.0)
        self.has_parent = self.parent >= 0


def _dual(iv: _Intervals, cap: float, lam: np.ndarray, nu: np.ndarray) -> tuple[float, np.ndarray]:
    """``L(lam, nu)`` and the maximising ``x`` (0/1) of the relaxed program."""
    prefix = np.concatenate(([0.0], np.cumsum(lam)))
    price = iv.s * (prefix[iv.b] - prefix[iv.a])
    wn = iv.w - nu
    if iv.has_parent.any():
        wn = wn + np.bincount(
            iv.parent[iv.has_parent], weights=nu[iv.has_parent], minlength=len(iv.w)
        )
    gain = wn - price
    x = gain > 0
    return cap * float(lam.sum()) + float(gain[x].sum()), x


def prefill_bound(
    trace: Sequence[Request],
    cfg: SimConfig,
    target: float = 0.0,
    iterations: int = 300,
) -> Bound:
    """An upper bound on the prefill seconds any policy saves on ``trace`` with a tier of
    ``cfg.capacity_bytes`` (see the module docstring). ``target``: a value some policy
    achieved (steers the step sizes; any value keeps the bound valid)."""
    iv = _Intervals(trace, cfg)
    n = len(iv.w)
    boundaries = max(iv.requests - 1, 1)
    unbounded = float(iv.w.sum())
    if n == 0:
        return Bound(cfg.capacity_bytes, 0.0, 0.0, 0.0, 0, 0)
    # sizes in units of the mean chunk, so that both kinds of price move at one scale
    unit = float(iv.s.mean())
    iv.s = iv.s / unit
    cap = float(cfg.capacity_bytes) / unit
    nu = np.zeros(n)

    def uniform(price: float) -> float:
        return _dual(iv, cap, np.full(boundaries, price), nu)[0]

    # the best uniform price: L is convex in it; golden-section search on [0, hi]
    hi = float((iv.w / iv.s).max())  # at this price per boundary no interval pays
    lo = 0.0
    g = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = hi - g * (hi - lo), lo + g * (hi - lo)
    fc, fd = uniform(c), uniform(d)
    for _ in range(60):
        if fc < fd:
            hi, d, fd = d, c, fc
            c = hi - g * (hi - lo)
            fc = uniform(c)
        else:
            lo, c, fc = c, d, fd
            d = lo + g * (hi - lo)
            fd = uniform(d)
    lam = np.full(boundaries, c if fc < fd else d)
    best = min(_dual(iv, cap, lam, nu)[0], unbounded, uniform(0.0))
    start = best
    # Polyak steps towards a level below the best value; the gap to the level halves
    # whenever 20 steps bring no improvement (a target-level subgradient method)
    delta = max(best - target, 0.02 * best) if target > 0 else 0.05 * best
    stale = 0
    steps = 0
    hp = iv.has_parent
    for _ in range(iterations):
        steps += 1
        val, x = _dual(iv, cap, lam, nu)
        if val < best - 1e-12 * abs(best):
            best = val
            stale = 0
        else:
            stale += 1
            if stale >= 20:
                delta *= 0.5
                stale = 0
        # subgradients: capacity left at each boundary, chain constraints' slack
        xs = iv.s * x
        load = np.zeros(boundaries + 1)
        np.add.at(load, iv.a, xs)
        np.add.at(load, iv.b, -xs)
        g_lam = cap - np.cumsum(load)[:boundaries]
        g_nu = np.zeros(n)
        g_nu[hp] = x[iv.parent[hp]].astype(np.float64) - x[hp]
        norm = float(g_lam @ g_lam + g_nu @ g_nu)
        if norm <= 0:
            break  # x is feasible and L = its value: the optimum
        step = (val - (best - delta)) / norm
        lam = np.maximum(lam - step * g_lam, 0.0)
        nu = np.maximum(nu - step * g_nu, 0.0)
    return Bound(cfg.capacity_bytes, best, start, unbounded, n, steps)
