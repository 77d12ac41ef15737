"""Placement policies (which tier keeps which chunk) and the trace simulator.

See ``docs/placement.md``: :class:`PlacementPolicy` is the interface a tier calls; LRU,
ARC and S3-FIFO are the baselines; :class:`CostAwarePolicy` keeps chunks by the prefill
time their hits save per byte; :func:`simulate` replays a trace through a tier model; :func:`prefill_bound` bounds
what any policy can save on it.
"""

from .base import ChunkInfo, PlacementPolicy, record_accesses, victim_in, victim_selector
from .baselines import ARCPolicy, LRUPolicy, S3FIFOPolicy
from .bound import Bound, prefill_bound
from .cost import PrefillCost
from .cost_aware import CostAwarePolicy
from .simulator import POLICIES, SimConfig, SimResult, SimTier, make_policy, simulate
from .traces import FAMILIES, Request, TraceError, generate, read_trace, write_trace

__all__ = [
    "FAMILIES",
    "POLICIES",
    "ARCPolicy",
    "Bound",
    "ChunkInfo",
    "CostAwarePolicy",
    "LRUPolicy",
    "PlacementPolicy",
    "PrefillCost",
    "Request",
    "S3FIFOPolicy",
    "SimConfig",
    "SimResult",
    "SimTier",
    "TraceError",
    "generate",
    "make_policy",
    "prefill_bound",
    "read_trace",
    "record_accesses",
    "simulate",
    "victim_in",
    "victim_selector",
    "write_trace",
]
