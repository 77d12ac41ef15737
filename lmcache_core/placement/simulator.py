"""Replay a request trace through a model of one cache tier, once per policy.

The model: a tier of ``capacity_bytes`` in front of recomputation. A request's chunks get
prefix-chained keys; the lookup serves the longest run of resident chunks from the first
(a lookup stops at the first miss, as :meth:`TieredHierarchy.lookup_prefix` does); the
rest is prefilled and offered to the tier (the policy admits or not; when the tier is
full the policy names victims; the request's own chunks are never evicted while it runs).
Costs come from :class:`~lmcache_core.placement.cost.PrefillCost` (compute) and the tier's
``bandwidth``/``latency_s`` (loads). Arrival times only order the requests: queueing is
not modelled, so TTFT is the request's own prefill plus load time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field

from .base import ChunkInfo, PlacementPolicy
from .baselines import ARCPolicy, LRUPolicy, S3FIFOPolicy
from .cost import PrefillCost
from .cost_aware import CostAwarePolicy
from .traces import Request

__all__ = [
    "POLICIES",
    "SimConfig",
    "SimResult",
    "SimTier",
    "chunk_chain",
    "make_policy",
    "simulate",
    "working_set_bytes",
]


@dataclass(frozen=True)
class SimConfig:
    """The modelled tier and engine: capacity, KV bytes per token, load bandwidth
    (bytes/s) and latency (s) of the tier, the prefill cost model."""

    capacity_bytes: int
    kv_bytes_per_token: int = 131072  # an 8B GQA model in 16-bit: 2*32*8*128*2
    bandwidth: float = 10e9
    latency_s: float = 0.0
    cost: PrefillCost = field(default_factory=PrefillCost)


@dataclass
class SimResult:
    """What one policy did on one trace at one capacity."""

    policy: str
    capacity_bytes: int
    requests: int
    prompt_tokens: int
    chunks: int
    hit_chunks: int
    tokens_saved: int
    compute_s_total: float  # prefill seconds with no cache at all
    compute_s_saved: float  # prefill seconds the hits saved
    load_s: float
    ttft_mean_s: float
    ttft_p99_s: float

    @property
    def hit_ratio(self) -> float:
        return self.hit_chunks / self.chunks if self.chunks else 0.0

    @property
    def compute_s_per_1k_tokens(self) -> float:
        """Prefill compute seconds actually spent per 1,000 prompt tokens."""
        spent = self.compute_s_total - self.compute_s_saved
        return 1000.0 * spent / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["hit_ratio"] = self.hit_ratio
        d["compute_s_per_1k_tokens"] = self.compute_s_per_1k_tokens
        return d


def chunk_chain(req: Request, kv_bytes_per_token: int) -> list[tuple[Hashable, ChunkInfo]]:
    """The request's chunks as (prefix-chained key, :class:`ChunkInfo`)."""
    out: list[tuple[Hashable, ChunkInfo]] = []
    parent: Hashable | None = None
    start = 0
    for pos, (group, tokens) in enumerate(zip(req.groups, req.chunk_tokens, strict=True)):
        key = hash((parent, group, tokens))
        out.append((key, ChunkInfo(parent, pos, tokens * kv_bytes_per_token, tokens, start)))
        parent = key
        start += tokens
    return out


def working_set_bytes(trace: Sequence[Request], kv_bytes_per_token: int, min_uses: int = 2) -> int:
    """Bytes of the distinct chunks the trace requests at least ``min_uses`` times (the
    default, 2, leaves out chunks no cache could ever serve; 1 counts every chunk)."""
    uses: dict[Hashable, int] = {}
    size: dict[Hashable, int] = {}
    for r in trace:
        for key, info in chunk_chain(r, kv_bytes_per_token):
            uses[key] = uses.get(key, 0) + 1
            size[key] = info.nbytes
    return sum(size[k] for k, n in uses.items() if n >= min_uses)


class SimTier:
    """A bounded tier whose admission and victims a policy decides."""

    def __init__(self, capacity_bytes: int, policy: PlacementPolicy) -> None:
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.resident: dict[Hashable, int] = {}
        self.used = 0
        self.evictions = 0

    def offer(self, key: Hashable, info: ChunkInfo, pinned: set[Hashable]) -> bool:
        """Store ``key`` if the policy admits it and room can be made; True if stored."""
        if key in self.resident or info.nbytes > self.capacity_bytes:
            return False
        if not self.policy.admit(key, info):
            return False
        while self.used + info.nbytes > self.capacity_bytes:
            victim = self.policy.victim(pinned)
            if victim is None or victim not in self.resident:
                return False
            self.used -= self.resident.pop(victim)
            self.policy.removed(victim)
            self.evictions += 1
        self.resident[key] = info.nbytes
        self.used += info.nbytes
        self.policy.inserted(key, info)
        return True


#: Policy name -> factory(config, mean chunk bytes).
POLICIES: dict[str, Callable[[SimConfig, int], PlacementPolicy]] = {
    "lru": lambda cfg, cb: LRUPolicy(),
    "arc": lambda cfg, cb: ARCPolicy(max(1, cfg.capacity_bytes // max(cb, 1))),
    "s3fifo": lambda cfg, cb: S3FIFOPolicy(max(1, cfg.capacity_bytes // max(cb, 1))),
    "cost": lambda cfg, cb: CostAwarePolicy(
        cfg.capacity_bytes, cfg.cost, cfg.bandwidth, cfg.latency_s, chunk_bytes_hint=cb
    ),
}


def make_policy(name: str, cfg: SimConfig, chunk_bytes: int) -> PlacementPolicy:
    """A fresh policy by name (a key of :data:`POLICIES`)."""
    try:
        return POLICIES[name](cfg, chunk_bytes)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(0.99 * len(s)) - 1))]


def simulate(trace: Sequence[Request], policy: str | PlacementPolicy, cfg: SimConfig) -> SimResult:
    """Replay ``trace`` (in arrival order) through one tier run by ``policy``."""
    chains = [chunk_chain(r, cfg.kv_bytes_per_token) for r in trace]
    nchunks = sum(len(c) for c in chains)
    mean_bytes = sum(i.nbytes for c in chains for _, i in c) // max(nchunks, 1)
    pol = make_policy(policy, cfg, mean_bytes) if isinstance(policy, str) else policy
    tier = SimTier(cfg.capacity_bytes, pol)
    cost = cfg.cost
    hits = tokens_saved = prompt_tokens = 0
    total_s = saved_s = load_s = 0.0
    ttfts: list[float] = []
    for chain in chains:
        served = True
        req_compute = req_load = 0.0
        for key, info in chain:
            resident = key in tier.resident
            pol.record_access(key, info, resident)
            seconds = cost.chunk_seconds(info.start_token, info.tokens)
            total_s += seconds
            prompt_tokens += info.tokens
            if served and resident:
                hits += 1
                tokens_saved += info.tokens
                saved_s += seconds
                req_load += info.nbytes / cfg.bandwidth + cfg.latency_s
            else:
                served = False
                req_compute += seconds
        pinned = {k for k, _ in chain}
        for key, info in chain:
            if key not in tier.resident:
                tier.offer(key, info, pinned)
        load_s += req_load
        ttfts.append(req_compute + req_load)
    name = pol.name
    return SimResult(
        policy=name,
        capacity_bytes=cfg.capacity_bytes,
        requests=len(chains),
        prompt_tokens=prompt_tokens,
        chunks=nchunks,
        hit_chunks=hits,
        tokens_saved=tokens_saved,
        compute_s_total=total_s,
        compute_s_saved=saved_s,
        load_s=load_s,
        ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        ttft_p99_s=_p99(ttfts),
    )
