"""The placement-policy interface: what a tier asks a policy, and the chunk facts it passes.

A :class:`PlacementPolicy` instance serves **one tier**. The tier (the simulator's
:class:`~lmcache_core.placement.simulator.SimTier` today; ``TieredHierarchy``'s tiers once
the hook is wired, see ``docs/placement.md``) calls it at four points:

* :meth:`~PlacementPolicy.record_access` on every lookup of a chunk in that tier, hit or
  miss (frequency and ghost state are learned here);
* :meth:`~PlacementPolicy.admit` before storing or promoting a chunk into the tier;
* :meth:`~PlacementPolicy.inserted` / :meth:`~PlacementPolicy.removed` when the tier's
  content changes (for any reason: eviction, removal, a shared tier's own eviction);
* :meth:`~PlacementPolicy.victim` when the tier needs room: the next resident key to evict
  (in-process tiers only; shared tiers keep their own cross-process eviction).

:func:`victim_selector` adapts a policy to the backend interface's
:data:`~lmcache_core.interface.VictimSelector` (the ``VictimSelection`` capability).
Policies do no I/O and hold no locks: the caller serialises calls per tier.

Two batched forms are optional. A policy may define
``record_accesses(keys, infos, hits)`` (one call per lookup instead of one per chunk) and
``victim_in(allowed, limit)`` (the first key in its eviction order that ``allowed``
contains, among ``limit`` candidates); they must decide exactly as the per-chunk calls
would. A policy without them gets the loops :func:`record_accesses` and :func:`victim_in`
use by default (over :meth:`~PlacementPolicy.record_access` and
:meth:`~PlacementPolicy.victim`), so a third-party policy needs only the five methods.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["ChunkInfo", "PlacementPolicy", "record_accesses", "victim_in", "victim_selector"]


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """What a policy may know about one chunk.

    ``parent``: the key of chunk ``position - 1`` of the same chain (``None`` for the first
    chunk). ``position``: the chunk's index in its chain. ``nbytes``: its stored size.
    ``tokens``: how many tokens it holds; ``start_token``: how many precede it.
    """

    parent: Hashable | None
    position: int
    nbytes: int
    tokens: int
    start_token: int


@runtime_checkable
class PlacementPolicy(Protocol):
    """Admission and eviction decisions for one tier (see the module docstring)."""

    name: str

    def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
        """A lookup asked for ``key`` in this tier; ``hit`` says whether it was there."""
        ...

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        """Whether ``key`` (not resident) should be stored into this tier now."""
        ...

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        """``key`` is now resident in this tier."""
        ...

    def removed(self, key: Hashable) -> None:
        """``key`` is no longer resident (evicted, removed, or gone from a shared tier)."""
        ...

    def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
        """The resident key to evict next, skipping those in ``exclude`` (``None``: no
        candidate). Residency does not change: the tier calls :meth:`removed` once it has
        evicted the key. (A policy may reorder its own queues while looking, as S3-FIFO
        does.)"""
        ...


def record_accesses(
    policy: PlacementPolicy,
    keys: Sequence[Hashable],
    infos: Sequence[ChunkInfo],
    hits: Sequence[bool],
) -> None:
    """Record one lookup's accesses: ``policy.record_accesses`` when the policy has it,
    else :meth:`~PlacementPolicy.record_access` for each (key, info, hit) in order."""
    batched = getattr(policy, "record_accesses", None)
    if batched is not None:
        batched(keys, infos, hits)
        return
    for key, info, hit in zip(keys, infos, hits, strict=True):
        policy.record_access(key, info, hit)


def victim_in(
    policy: PlacementPolicy, allowed: Container[Hashable], limit: int = 64
) -> Hashable | None:
    """The first key in ``policy``'s eviction order that ``allowed`` contains, asking for
    at most ``limit`` victims (``None``: none found): ``policy.victim_in`` when the
    policy has it, else :meth:`~PlacementPolicy.victim` asked again with every named key
    that ``allowed`` refused excluded."""
    batched = getattr(policy, "victim_in", None)
    if batched is not None:
        found: Hashable | None = batched(allowed, limit)
        return found
    seen: set[Hashable] = set()
    for _ in range(limit):
        key = policy.victim(seen)
        if key is None:
            return None
        if key in allowed:
            return key
        seen.add(key)
    return None


def victim_selector(
    policy: PlacementPolicy, max_victims: int = 64
) -> Callable[[Sequence[Hashable], int], list[Hashable]]:
    """A :data:`~lmcache_core.interface.VictimSelector` for a backend with the
    ``VictimSelection`` capability.

    The backend passes its evictable candidates (never pinned or in-flight ones) and the
    room it needs; this returns up to ``max_victims`` keys, in the policy's order, that
    are among the candidates. The backend evicts them in order and falls back to its own
    order for any room still missing, so a policy that lags the backend never blocks an
    eviction. Residency changes reach the policy through :meth:`PlacementPolicy.removed`
    when the backend reports the evictions.
    """

    def select(candidates: Sequence[Hashable], nbytes: int) -> list[Hashable]:
        del nbytes  # the backend keeps evicting in order until it has the room
        allowed = set(candidates)
        seen: set[Hashable] = set()
        out: list[Hashable] = []
        while len(out) < max_victims and len(seen) < len(allowed) + max_victims:
            key = policy.victim(seen)
            if key is None:
                break
            seen.add(key)
            if key in allowed:
                out.append(key)
        return out

    return select
