"""How a hierarchy's tier talks to its placement policy.

:class:`TierPlacement` wraps one tier's :class:`~lmcache_core.placement.base.PlacementPolicy`
behind a lock (the cpu tier's thread-safe fast paths call it from other threads; policies
hold no locks themselves) and turns the hierarchy's events into the policy's calls:

* a lookup consulted the tier for some keys: :meth:`~TierPlacement.looked_up` records one
  access per key (hit or miss) and keeps the policy's idea of what is resident in step
  with what the tier answered (a shared tier's content also changes from other processes);
* a store or promotion is about to be queued: :meth:`~TierPlacement.admits`;
* a store finished: :meth:`~TierPlacement.stored`; the tier evicted or removed a key:
  :meth:`~TierPlacement.removed`;
* an in-process tier needs room: :meth:`~TierPlacement.selector` is the backend's
  ``VictimSelector``.

A policy needs each chunk's place in its chain (:class:`ChunkInfo`); keys do not carry
it, so a :class:`ChainBook` shared by the hierarchy's tiers learns it from the lookups,
which see a prompt's keys in chain order (``parent = keys[i-1]``, ``position = i``).
A key stored without a lookup first is treated as a chain's first chunk.

:class:`PolicyContext` is what a policy factory (the ``lmcache_register_policies`` hook)
gets for one tier; :data:`BUILTIN_FACTORIES` are the built-in ones.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from .base import ChunkInfo, PlacementPolicy, record_accesses, victim_in
from .baselines import ARCPolicy, LRUPolicy, S3FIFOPolicy
from .cost import PrefillCost
from .cost_aware import CostAwarePolicy

__all__ = [
    "BUILTIN_FACTORIES",
    "DEFAULT_KV_BYTES_PER_TOKEN",
    "ChainBook",
    "PolicyContext",
    "PolicyFactory",
    "TierPlacement",
    "arc_policy",
    "cost_policy",
    "lru_policy",
    "policy_context",
    "s3fifo_policy",
]


@dataclass(frozen=True)
class PolicyContext:
    """What a policy factory knows about the tier it makes a policy for.

    ``capacity_bytes``: the tier's size when it declares one (the ``cpu`` tier's
    ``max_bytes``), else ``None`` (a shared tier: the policy decides admission and
    promotion only). ``chunk_bytes``: the expected size of one chunk (for policies that
    count in chunks). ``options``: the ``placement:`` section's options for this tier.
    """

    tier: str
    capacity_bytes: int | None
    chunk_bytes: int
    shared: bool
    options: Mapping[str, Any] = field(default_factory=dict)


#: ``factory(context) -> policy``: one fresh policy per tier.
PolicyFactory = Callable[[PolicyContext], PlacementPolicy]

#: KV bytes per token assumed for a chunk's size until one is stored (an 8B GQA model in
#: 16-bit); the ``placement`` option ``chunk_bytes`` replaces the estimate.
DEFAULT_KV_BYTES_PER_TOKEN = 131072

#: ``placement`` options read by the hierarchy itself, not passed to a policy.
HIERARCHY_OPTIONS = ("chunk_bytes",)


def policy_context(
    tier: Any, placement: Any, chunk_size: int, charge: Callable[[int], int] | None = None
) -> PolicyContext:
    """The :class:`PolicyContext` of configured tier ``tier`` (a ``TierConfig``) under the
    ``placement`` section (``PlacementSettings``): its options are ``placement.options``
    updated by ``placement.tiers[tier.name]``; capacity is the backend's ``max_bytes``
    unless the tier is shared (other processes write it: no capacity is known).
    ``charge``: what the backend charges an entry of so many bytes against ``max_bytes``
    (its ``entry_cost``, see :class:`TierPlacement`); ``chunk_bytes`` is then the charge of
    one chunk, so that a capacity counted in chunks is the backend's."""
    options = dict(placement.options)
    options.update(placement.tiers.get(tier.name, {}))
    chunk_bytes = int(options.pop("chunk_bytes", chunk_size * DEFAULT_KV_BYTES_PER_TOKEN))
    if charge is not None:
        chunk_bytes = charge(chunk_bytes)
    caps = tier.capabilities
    shared = bool(caps is not None and caps.shared)
    max_bytes = getattr(tier.options, "max_bytes", None)
    capacity = int(max_bytes) if isinstance(max_bytes, int) and not shared else None
    return PolicyContext(tier.name, capacity, chunk_bytes, shared, options)


_UNBOUNDED = 1 << 62


def _chunks(ctx: PolicyContext) -> int:
    if ctx.capacity_bytes is None:
        return 1 << 20
    return max(1, ctx.capacity_bytes // max(ctx.chunk_bytes, 1))


def lru_policy(ctx: PolicyContext) -> PlacementPolicy:
    """``lru``: every tier's order today (no options)."""
    _no_options("lru", ctx.options)
    return LRUPolicy()


def arc_policy(ctx: PolicyContext) -> PlacementPolicy:
    """``arc``: ARC over the tier's capacity in chunks (no options)."""
    _no_options("arc", ctx.options)
    return ARCPolicy(_chunks(ctx))


def s3fifo_policy(ctx: PolicyContext) -> PlacementPolicy:
    """``s3fifo``: S3-FIFO over the tier's capacity in chunks (option ``small_fraction``)."""
    o = dict(ctx.options)
    small = float(o.pop("small_fraction", 0.1))
    _no_options("s3fifo", o)
    return S3FIFOPolicy(_chunks(ctx), small)


def _no_options(name: str, options: Mapping[str, Any]) -> None:
    if options:
        raise ValueError(f"unknown option(s) for the {name} policy: {', '.join(sorted(options))}")


def cost_policy(ctx: PolicyContext) -> PlacementPolicy:
    """``cost``: :class:`CostAwarePolicy`; options ``tokens_per_s``, ``attn_tokens``,
    ``bandwidth_gbps``, ``latency_s``, ``half_life``, ``min_reuse``, ``history``,
    ``adapt``, ``short_factor``, ``long_factor``, ``hold``, ``hold_margin``."""
    o = dict(ctx.options)
    cost = PrefillCost(
        tokens_per_s=float(o.pop("tokens_per_s", 8000.0)),
        attn_tokens=float(o.pop("attn_tokens", 16384.0)),
    )
    bandwidth = float(o.pop("bandwidth_gbps", 10.0)) * 1e9
    known = {
        "latency_s",
        "half_life",
        "min_reuse",
        "history",
        "adapt",
        "short_factor",
        "long_factor",
        "hold",
        "hold_margin",
    }
    unknown = sorted(set(o) - known)
    if unknown:
        raise ValueError(f"unknown option(s) for the cost policy: {', '.join(unknown)}")
    return CostAwarePolicy(
        ctx.capacity_bytes if ctx.capacity_bytes is not None else _UNBOUNDED,
        cost,
        bandwidth,
        chunk_bytes_hint=ctx.chunk_bytes if ctx.capacity_bytes is not None else 0,
        **o,
    )


#: The built-in policies, registered through the same hook as plugins' ones.
BUILTIN_FACTORIES: dict[str, PolicyFactory] = {
    "lru": lru_policy,
    "arc": arc_policy,
    "s3fifo": s3fifo_policy,
    "cost": cost_policy,
}


class ChainBook:
    """Each recently looked-up key's parent and position (bounded, least recent dropped)."""

    def __init__(self, chunk_tokens: int = 256, capacity: int = 1 << 18) -> None:
        self.chunk_tokens = chunk_tokens
        self.capacity = capacity
        self._links: OrderedDict[Hashable, tuple[Hashable | None, int]] = OrderedDict()
        self._lock = threading.Lock()

    def learn(self, keys: Sequence[Hashable]) -> None:
        """Remember the chain ``keys`` (a prompt's keys in order, from its first chunk)."""
        links = self._links
        with self._lock:
            parent: Hashable | None = None
            for pos, key in enumerate(keys):
                links[key] = (parent, pos)
                links.move_to_end(key)
                parent = key
            while len(links) > self.capacity:
                links.popitem(last=False)

    def info(self, key: Hashable, nbytes: int) -> ChunkInfo:
        """``key``'s :class:`ChunkInfo` (a chain's first chunk when never looked up)."""
        link = self._links.get(key)
        parent, pos = link if link is not None else (None, 0)
        t = self.chunk_tokens
        return ChunkInfo(parent, pos, nbytes, t, pos * t)


class _Evictable(AbstractSet[Hashable]):
    """A set view over the candidates a backend offers (no copy)."""

    def __init__(self, candidates: Sequence[Hashable] | AbstractSet[Hashable]) -> None:
        self._c = candidates

    def __contains__(self, key: object) -> bool:
        return key in self._c

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._c)

    def __len__(self) -> int:
        return len(self._c)


class TierPlacement:
    """One tier's policy behind a lock (see the module docstring).

    ``charge``: the backend's ``entry_cost(nbytes)`` when it has one (the ``cpu`` backend:
    the buffer as allocated plus a per-entry overhead); every size the policy sees (each
    :class:`ChunkInfo`'s ``nbytes``) is then what the backend charges against the bound
    it evicts by, so the policy's idea of a full tier is the backend's. Without it a
    policy counting value bytes would see room the backend does not have (64 KiB chunks
    and 1 KiB per entry: one chunk more per 64 held) and admit every chunk unasked.
    ``chunk_bytes``: the size assumed for a key not stored yet, already charged."""

    def __init__(
        self,
        policy: PlacementPolicy,
        book: ChainBook,
        chunk_bytes: int,
        chooses_victims: bool,
        charge: Callable[[int], int] | None = None,
    ) -> None:
        self.policy = policy
        self.book = book
        self.chunk_bytes = chunk_bytes
        #: Whether the tier's backend asks this policy for victims (``VictimSelection``).
        self.chooses_victims = chooses_victims
        self._lock = threading.Lock()
        self._sizes: dict[Hashable, int] = {}  # charged sizes of the resident keys
        self._charge = charge
        self._charged: dict[int, int] = {}  # charge by value size (a few sizes)
        batched = getattr(policy, "record_accesses", None)
        self._record: Callable[[Sequence[Hashable], Sequence[ChunkInfo], Sequence[bool]], None] = (
            batched if batched is not None else partial(record_accesses, policy)
        )

    @property
    def name(self) -> str:
        return self.policy.name

    def charged(self, nbytes: int) -> int:
        """What the tier charges a value of ``nbytes`` (``nbytes`` without ``charge``)."""
        charge = self._charge
        if charge is None:
            return nbytes
        c = self._charged.get(nbytes)
        if c is None:
            if len(self._charged) > 4096:
                self._charged.clear()
            c = self._charged[nbytes] = charge(nbytes)
        return c

    def looked_up(self, keys: Sequence[Hashable], found: Sequence[bool | None]) -> None:
        """The tier answered ``found`` for ``keys``: one access each; a hit the policy did
        not know is now resident, a miss it thought resident is gone.

        When every answer agrees with what the policy holds (the usual case) the accesses
        go to the policy in one batched call (:func:`~.base.record_accesses`); otherwise
        key by key, each access followed by its correction, in order."""
        pol = self.policy
        sizes = self._sizes
        info_of = self.book.info
        cb = self.chunk_bytes
        with self._lock:
            n = min(len(keys), len(found))
            infos: list[ChunkInfo] = []
            agree = True
            for i in range(n):
                key = keys[i]
                nbytes = sizes.get(key)
                if (nbytes is None) == bool(found[i]):
                    agree = False
                infos.append(info_of(key, cb if nbytes is None else nbytes))
            if agree:
                hits = [bool(h) for h in found[:n]]
                self._record(keys[:n] if n < len(keys) else keys, infos, hits)
                return
            for i in range(n):
                key, info, hit = keys[i], infos[i], bool(found[i])
                pol.record_access(key, info, hit)
                if hit and key not in sizes:
                    sizes[key] = info.nbytes
                    pol.inserted(key, info)
                elif not hit and key in sizes:
                    del sizes[key]
                    pol.removed(key)

    def admits(self, key: Hashable, nbytes: int) -> bool:
        """Whether the policy lets ``key`` (``nbytes``) into the tier now. An admitted key
        counts as resident from here on: the store is queued, and the next chunk of the
        chain (whose admission needs its parent) is asked before it finishes. A store
        that then fails is corrected by the next lookup's miss."""
        nbytes = self.charged(nbytes)
        with self._lock:
            if key in self._sizes:
                return True  # already resident: a rewrite is not a new admission
            info = self.book.info(key, nbytes)
            if not self.policy.admit(key, info):
                return False
            self._sizes[key] = nbytes
            self.policy.inserted(key, info)
            return True

    def stored(self, key: Hashable, nbytes: int) -> None:
        """``key`` is now resident."""
        nbytes = self.charged(nbytes)
        with self._lock:
            if key in self._sizes:
                return
            self._sizes[key] = nbytes
            self.policy.inserted(key, self.book.info(key, nbytes))

    def removed(self, key: Hashable) -> None:
        """``key`` left the tier (evicted, removed)."""
        with self._lock:
            if self._sizes.pop(key, None) is not None:
                self.policy.removed(key)

    def selector(self) -> Callable[[Any, int], list[Hashable]]:
        """A ``VictimSelector``: the policy's next victim among the backend's candidates
        (one per call, among the policy's first 64 candidates, found by
        :func:`~.base.victim_in`: one pass when the policy has ``victim_in``; the backend
        falls back to its own order when it gets none)."""
        pol = self.policy
        lock = self._lock
        find: Callable[[Container[Hashable], int], Hashable | None] = getattr(
            pol, "victim_in", None
        ) or partial(victim_in, pol)

        def select(candidates: Any, nbytes: int) -> list[Hashable]:
            del nbytes
            allowed = candidates if isinstance(candidates, AbstractSet) else _Evictable(candidates)
            with lock:
                key = find(allowed, 64)
            return [] if key is None else [key]

        return select
