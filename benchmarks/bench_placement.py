"""Decision cost of the placement policies on the lookup/store path, per chunk.

A stream of ``--chunks`` chunk accesses (the RAG trace, alpha 0.8, prefix-chained keys)
goes through the simulator's tier (:class:`~lmcache_core.placement.simulator.SimTier`):
per chunk a lookup (``record_access``) and, on a miss, admission, room-making (victims)
and insertion, at a capacity of 25% of the working set. Each policy runs against a no-op
policy (admits everything, evicts in insertion order, learns nothing) in ``--rounds``
interleaved rounds; the no-op runs twice per round (A/A spread). Printed: per-chunk
median of each policy minus the no-op's median, which the issue bounds at 5 µs.

With ``--hierarchy`` the same stream goes through the real lookup/store path instead: a
started :class:`~lmcache_core.TieredHierarchy` with one ``cpu`` tier (25% of the working
set, 64 KiB chunks by default: ``--chunk-bytes``) configured with
``placement: {policy: NAME}``, per request ``lookup_prefix`` of its keys, then
``batched_put`` of the missing ones. The baseline there is a **replay** of the policy's
own decisions: an untimed run records every ``admit`` answer and ``victim`` choice the
policy made, and a no-op policy (it learns nothing) hands them back in the same order,
so both sides store, evict and hit exactly the same chunks and differ only in the time
the policy spends deciding (a plain no-op policy that admits everything would do other
work: the cost-aware policy refuses chunks and so stores fewer). The runs check that the
replay reproduced the hits. Both policies are registered through ``add_policy``, so both
take the same code path. Every timed run starts after ``gc.collect()`` with only the
recorded decisions kept from earlier runs (no policy object of an earlier run alive), in
an order rotated each round; the time each arm spent in the collector is printed.

To compare two versions of the cost policy in one process (``--hierarchy`` only),
``--cost-policy-file NAME=PATH`` loads another ``cost_aware.py`` (e.g. ``main``'s, from
``git archive``) and registers it as policy ``NAME``, built by the same ``cost`` factory;
list ``NAME`` in ``--policies`` beside ``cost``. Each policy then gets its own recorded
decisions and replay arms, all arms interleaved, and every round's time is printed so
that the two can be paired round by round.

Run: ``flock /tmp/lmcache-heavy.lock .venv/bin/python benchmarks/bench_placement.py``
(add ``--hierarchy`` for the real path)
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import statistics
import time
from collections import OrderedDict
from collections.abc import Container, Hashable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from _util import aa_spread

from lmcache_core.placement import ChunkInfo, PlacementPolicy, SimConfig, SimTier, make_policy
from lmcache_core.placement.base import record_accesses, victim_in
from lmcache_core.placement.simulator import chunk_chain, working_set_bytes
from lmcache_core.placement.traces import rag_trace


class GcClock:
    """Time spent in the garbage collector (``gc.callbacks``) and full collections."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._t0 = 0.0
        gc.callbacks.append(self._cb)

    def reset(self) -> None:
        self.seconds = 0.0
        self.full = 0

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full += info["generation"] == 2


class NoopPolicy:
    """Admits everything and evicts in insertion order: the cheapest possible policy."""

    name = "noop"

    def __init__(self) -> None:
        # OrderedDict: iterating a plain dict from the front after many pops from the
        # front walks the deleted slots (measured slower than LRU's queue).
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
        pass

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        return True

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        self._keys[key] = None

    def removed(self, key: Hashable) -> None:
        self._keys.pop(key, None)

    def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
        for key in self._keys:
            if key not in exclude:
                return key
        return None


def replay(
    stream: list[list[tuple[Hashable, ChunkInfo]]], policy: PlacementPolicy, cap: int
) -> float:
    """Seconds to push the stream through one tier run by ``policy``."""
    tier = SimTier(cap, policy)
    resident = tier.resident
    t0 = time.perf_counter()
    for chain in stream:
        pinned = {k for k, _ in chain}
        for key, info in chain:
            policy.record_access(key, info, key in resident)
        for key, info in chain:
            if key not in resident:
                tier.offer(key, info, pinned)
    return time.perf_counter() - t0


class Recorder:
    """Delegates to ``inner`` and records its ``admit`` answers and ``victim`` choices
    (the batched calls go to the inner policy's batched forms, or their per-chunk loops,
    exactly as the hierarchy would call them)."""

    def __init__(self, inner: PlacementPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.admits: list[bool] = []
        self.victims: list[Hashable | None] = []

    def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
        self.inner.record_access(key, info, hit)

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        ok = self.inner.admit(key, info)
        self.admits.append(ok)
        return ok

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        self.inner.inserted(key, info)

    def removed(self, key: Hashable) -> None:
        self.inner.removed(key)

    def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
        key = self.inner.victim(exclude)
        self.victims.append(key)
        return key

    def record_accesses(
        self, keys: Sequence[Hashable], infos: Sequence[ChunkInfo], hits: Sequence[bool]
    ) -> None:
        record_accesses(self.inner, keys, infos, hits)

    def victim_in(self, allowed: Container[Hashable], limit: int = 64) -> Hashable | None:
        key = victim_in(self.inner, allowed, limit)
        self.victims.append(key)
        return key


class ReplayPolicy:
    """The no-op baseline of ``--hierarchy``: learns nothing and hands back a recorded
    policy's decisions in order (so the tier does exactly the same work). It has the
    batched forms too (no-ops), so both sides take the same calls."""

    name = "replay"

    def __init__(self, admits: list[bool], victims: list[Hashable | None]) -> None:
        self._admits = iter(admits)
        self._victims = iter(victims)

    def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
        pass

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        return next(self._admits, True)

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        pass

    def removed(self, key: Hashable) -> None:
        pass

    def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
        return next(self._victims, None)

    def record_accesses(
        self, keys: Sequence[Hashable], infos: Sequence[ChunkInfo], hits: Sequence[bool]
    ) -> None:
        pass

    def victim_in(self, allowed: Container[Hashable], limit: int = 64) -> Hashable | None:
        return next(self._victims, None)


async def replay_hierarchy(
    reqs: list[list[Any]], policy: str, cap_chunks: int, registry: Any, nbytes: int = 65536
) -> tuple[float, int]:
    """Seconds to push the requests' keys through a real hierarchy whose tier runs the
    registered ``policy``, and the chunks the lookups found."""
    import torch

    from lmcache_core import TieredHierarchy
    from lmcache_core.backends.host_buffers import ENTRY_OVERHEAD
    from lmcache_core.config import load_config

    cfg = load_config(
        {
            "tiers": [
                {"backend": "cpu", "options": {"max_bytes": cap_chunks * (nbytes + ENTRY_OVERHEAD)}}
            ],
            "placement": {"policy": policy, "options": {"chunk_bytes": nbytes}},
        },
        registry=registry,
    )
    value = torch.zeros(nbytes, dtype=torch.uint8)
    hits = 0
    async with TieredHierarchy(cfg) as h:
        t0 = time.perf_counter()
        for keys in reqs:
            hit = (await h.lookup_prefix(keys)).num_hit
            hits += hit
            if hit < len(keys):
                miss = keys[hit:]
                await h.batched_put(miss, [value] * len(miss))
        return time.perf_counter() - t0, hits


def cost_policy_from_file(name: str, path: str) -> Any:
    """A policy factory building ``path``'s ``CostAwarePolicy`` (another version of
    ``lmcache_core/placement/cost_aware.py``, loaded as a module of the same package so
    that its relative imports resolve) through the ``cost`` factory, options and all."""
    import importlib.util
    import sys

    import lmcache_core.placement.wiring as wiring

    mod_name = f"lmcache_core.placement._bench_{name}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--cost-policy-file: cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    print(f"policy {name}: CostAwarePolicy from {mod.__file__}")

    def make(ctx: Any) -> PlacementPolicy:
        # ``cost_policy`` builds the class its module names: swap that name for the call
        names = vars(wiring)
        real = names["CostAwarePolicy"]
        names["CostAwarePolicy"] = mod.CostAwarePolicy
        try:
            return wiring.cost_policy(ctx)
        finally:
            names["CostAwarePolicy"] = real

    return make


def main_hierarchy(
    stream: list[list[tuple[Hashable, ChunkInfo]]], n: int, cap: int, args: Any
) -> int:
    import asyncio

    from lmcache_core import CacheEngineKey
    from lmcache_core.placement.wiring import BUILTIN_FACTORIES, PolicyContext
    from lmcache_core.plugins import BackendRegistry, PluginSettings, load_plugins

    registry = BackendRegistry()
    load_plugins(registry, entry_points=[], settings=PluginSettings(strict=True))
    clock = GcClock()
    cap_chunks = max(1, cap // (256 * 131072))
    policies = args.policies.split(",")
    factories = dict(BUILTIN_FACTORIES)
    for item in args.cost_policy_file:
        name, sep, path = item.partition("=")
        if not sep or not name.isalnum():
            raise SystemExit(f"--cost-policy-file: NAME=PATH with an alphanumeric NAME: {item}")
        factories[name] = cost_policy_from_file(name, path)
    # Only the recorded decisions outlive the recording run: keeping its policy (or any
    # timed run's policy) alive would leave 10^5 tracked objects in the heap that every
    # later full collection walks, in whichever run it lands.
    recorder: dict[str, Recorder] = {}
    recorded: dict[str, tuple[list[bool], list[Hashable | None]]] = {}

    def factory_for(name: str) -> Any:
        def make(ctx: PolicyContext) -> PlacementPolicy:
            if name.startswith("replay-"):
                admits, victims = recorded[name[7:]]
                return ReplayPolicy(admits, victims)
            base = name[4:] if name.startswith("rec-") else name
            pol: PlacementPolicy = factories[base](ctx)
            if name.startswith("rec-"):
                recorder[base] = rec = Recorder(pol)
                return rec
            return pol

        return make

    for p in policies:
        for name in (f"x-{p}", f"rec-{p}", f"replay-{p}"):
            registry.add_policy(name, factory_for(name if not name.startswith("x-") else p))
    # Chunk hashes numbered by first appearance (the simulator's keys hash None, whose hash
    # is its address: they differ from process to process), so that every process stores
    # the same keys and the decisions' digest compares across processes and versions.
    ids: dict[Hashable, int] = {}

    def stable(k: Hashable) -> int:
        return (ids.setdefault(k, len(ids)) * 0x9E3779B97F4A7C15 + 12345) & 0xFFFFFFFFFFFFFFFF

    reqs = [
        [CacheEngineKey("bench", 1, 0, stable(k), "uint8") for k, _ in chain] for chain in stream
    ]

    def run(name: str, part: list[list[Any]]) -> tuple[float, int]:
        return asyncio.run(replay_hierarchy(part, name, cap_chunks, registry, args.chunk_bytes))

    # the decisions each policy makes on this stream (recorded once, untimed)
    expected = {}
    for p in policies:
        expected[p] = run(f"rec-{p}", reqs)[1]
        rec = recorder.pop(p)
        recorded[p] = (rec.admits, rec.victims)
        digest = hashlib.sha256(repr(recorded[p]).encode()).hexdigest()[:16]
        print(
            f"{p}: {sum(rec.admits)} admitted, {len(rec.admits) - sum(rec.admits)} refused, "
            f"{len(rec.victims)} victims named, decisions sha256 {digest}",
            flush=True,
        )
        del rec
    names = [x for p in policies for x in (f"x-{p}", f"replay-{p}-A", f"replay-{p}-B")]
    samples: dict[str, list[float]] = {k: [] for k in names}
    gc_secs: dict[str, list[float]] = {k: [] for k in names}
    gc_full: dict[str, int] = dict.fromkeys(names, 0)
    for p in policies:  # warm-up
        run(f"x-{p}", reqs[: len(reqs) // 20])
    for r in range(args.rounds):
        # rotated, so that no arm always follows the same one
        for name in names[r % len(names) :] + names[: r % len(names)]:
            reg = name[:-2] if name.startswith("replay-") else name
            gc.collect()  # every run starts from the same heap: the last runs' garbage gone
            clock.reset()
            secs, hits = run(reg, reqs)
            if hits != expected[name.split("-")[1]]:
                raise SystemExit(f"{name}: {hits} hits, the recorded run had {expected}")
            samples[name].append(secs / n)
            gc_secs[name].append(clock.seconds / n)
            gc_full[name] += clock.full
    print(f"{n} chunks per round, {args.rounds} interleaved rounds, tier = 25% of working set")
    print("path: the hierarchy's lookup_prefix + batched_put, cpu tier")
    print("baseline: a no-op policy replaying the policy's own decisions (same work)")
    print("each run after gc.collect(); only the recorded decisions kept between runs")
    for name in names:
        rounds = " ".join(f"{1e6 * x:.2f}" for x in samples[name])
        print(f"  {name:<16} us/chunk per round: {rounds}")
        print(
            f"  {name:<16} collector {1e6 * statistics.median(gc_secs[name]):5.2f} us/chunk "
            f"(median), full collections {gc_full[name]} in {args.rounds} runs"
        )
    print(
        f"{'policy':<8} {'us/chunk':>9} {'replay':>9} {'A/A':>7} {'minus replay':>13} "
        f"{'ratio':>7}  within 5 us"
    )
    for p in policies:
        a, b = samples[f"replay-{p}-A"], samples[f"replay-{p}-B"]
        base = statistics.median(a + b)
        med = statistics.median(samples[f"x-{p}"])
        extra = 1e6 * (med - base)
        print(
            f"{p:<8} {1e6 * med:9.2f} {1e6 * base:9.2f} {aa_spread(a, b):6.3f}x {extra:13.2f} "
            f"{med / base:7.2f}  {'yes' if extra <= 5 else 'NO'}"
        )
    return 0


def report(samples: dict[str, list[float]], args: Any, n: int, what: str) -> None:
    base = statistics.median(samples["noop-A"] + samples["noop-B"])
    spread = aa_spread(samples["noop-A"], samples["noop-B"])
    print(f"{n} chunks per round, {args.rounds} interleaved rounds, tier = 25% of working set")
    print(f"path: {what}")
    print(f"no-op policy: {1e6 * base:.2f} us/chunk (A/A spread {spread:.3f}x)")
    print(f"{'policy':<8} {'us/chunk':>9} {'minus no-op':>12} {'ratio':>7}  within 5 us")
    for name in args.policies.split(","):
        med = statistics.median(samples[name])
        extra = 1e6 * (med - base)
        print(
            f"{name:<8} {1e6 * med:9.2f} {extra:12.2f} {med / base:7.2f}  {'yes' if extra <= 5 else 'NO'}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=100_000, help="chunks per round (default 1e5)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--policies", default="lru,arc,s3fifo,cost")
    ap.add_argument(
        "--hierarchy", action="store_true", help="the real lookup/store path (see the docstring)"
    )
    ap.add_argument(
        "--cost-policy-file",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="--hierarchy: also the policy NAME, the CostAwarePolicy of PATH (another "
        "version's cost_aware.py) built by the cost factory; list NAME in --policies",
    )
    ap.add_argument(
        "--chunk-bytes",
        type=int,
        default=65536,
        help="--hierarchy: bytes per stored chunk (default 64 KiB; the cpu tier also "
        "charges 1 KiB per entry, and the policy sees sizes as charged)",
    )
    args = ap.parse_args()
    import lmcache_core

    print(f"lmcache_core: {lmcache_core.__file__}")
    trace = rag_trace(n_requests=args.chunks // 4 + 100, alpha=0.8)
    kvb = 131072
    stream: list[list[tuple[Hashable, ChunkInfo]]] = []
    n = 0
    for r in trace:
        chain = chunk_chain(r, kvb)
        stream.append(chain)
        n += len(chain)
        if n >= args.chunks:
            break
    cap = int(working_set_bytes(trace, kvb) * 0.25)
    if args.hierarchy:
        return main_hierarchy(stream, n, cap, args)
    cfg = SimConfig(cap, kvb)
    mean_bytes = 256 * kvb
    names = ["noop-A", *args.policies.split(","), "noop-B"]
    samples: dict[str, list[float]] = {k: [] for k in names}

    def fresh(name: str) -> PlacementPolicy:
        return NoopPolicy() if name.startswith("noop") else make_policy(name, cfg, mean_bytes)

    for name in names:  # warm-up
        replay(stream[: len(stream) // 10], fresh(name), cap)
    for _ in range(args.rounds):
        for name in names:
            pol = fresh(name)
            gc.collect()  # the same heap for every run: the last run's garbage gone
            samples[name].append(replay(stream, pol, cap) / n)
            del pol
    report(samples, args, n, "the simulator's tier (the policy alone)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
