"""What knowing the popularity is worth on the generated stationary traces.

The `system`, `rag-*` and `mix` families draw every request independently from a fixed
popularity (Zipf over prompts or documents; in `mix`, a request's kind is a shuffle of
fixed shares). Under such independent requests, the tier's content before a request does
not depend on that request, so **any** online policy's expected saving on it is at most
``max over fixed contents S of E[saving | S]``: the best fixed content with the true
probabilities (Aho, Denning and Ullman's A0). This script computes, per family, seed and
capacity (relative to the best of LRU/ARC/S3-FIFO on the same trace, as
``lmcache-core simulate`` reports):

* ``E[bound]``: ``n x`` the largest expected saving per request of any fixed content,
  relaxed (a fractional knapsack over chunks by probability x prefill seconds, without
  the prefix constraint and without the cold start): at least what any online policy
  saves **in expectation** on a trace of this structure;
* ``A0``: the fixed content chosen greedily from the true probabilities (each chunk with
  the missing part of its prefix, as ``StaticOracle`` does with the trace's counts),
  replayed on the trace (realized), and ``E[A0]`` with ``sd`` its expectation and
  standard deviation over draws of the requests (the luck a fixed content can have);
* ``hindsight``: the largest saving of any fixed content on this very trace, relaxed
  (the top chunks by ``(requests - 1) x`` prefill seconds, no prefix constraint): a fixed
  content, even chosen knowing the trace, saves no more;
* the cost-aware policy and ``StaticOracle`` (realized), for comparison.

The probabilities come from replaying the generators' own draws of the prompt and
document lengths (checked against the trace: every request of an item starts with the
item's chunks).

    cd benchmarks && ../.venv/bin/python popularity_bound.py --family mix --capacity 0.1
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from lmcache_core.placement.oracle import StaticOracle
from lmcache_core.placement.simulator import (
    SimConfig,
    chunk_chain,
    simulate,
    working_set_bytes,
)
from lmcache_core.placement.traces import Request, generate

BASELINES = ("lru", "arc", "s3fifo")


@dataclass
class Item:
    """One reused prompt or document: the chunk groups a request of it starts with (a
    RAG document with the shared instruction before it) and its probability per
    request."""

    groups: list[int]
    prob: float


def _zipf(n: int, alpha: float) -> list[float]:
    w = [1.0 / (k + 1) ** alpha for k in range(n)]
    z = sum(w)
    return [x / z for x in w]


def _system_items(seed: int, share: float) -> list[Item]:
    # system_prompt_trace's first draws: 20 prompt lengths, ids from 1 << 40
    rng = random.Random(seed)
    nxt = 1 << 40
    out = []
    lengths = [rng.randint(2, 16) for _ in range(20)]
    for n, p in zip(lengths, _zipf(20, 1.0), strict=True):
        out.append(Item(list(range(nxt, nxt + n)), share * p))
        nxt += n
    return out


def _rag_items(seed: int, alpha: float, share: float) -> list[Item]:
    # rag_trace's first draws: 1,000 document lengths; ids from 2 << 40, the 2-chunk
    # instruction first
    rng = random.Random(seed)
    base = 2 << 40
    instruction = [base, base + 1]
    nxt = base + 2
    out = []
    lengths = [rng.randint(2, 8) for _ in range(1000)]
    for n, p in zip(lengths, _zipf(1000, alpha), strict=True):
        out.append(Item(instruction + list(range(nxt, nxt + n)), share * p))
        nxt += n
    return out


def items_of(family: str, seed: int, trace: Sequence[Request]) -> list[Item]:
    """The reused items of a generated trace with their probabilities per request,
    checked against ``trace``."""
    kinds: dict[str, int] = {}
    for r in trace:
        kinds[r.meta["family"]] = kinds.get(r.meta["family"], 0) + 1
    n = len(trace)
    if family == "system":
        items = _system_items(seed, 1.0)
    elif family.startswith("rag-a"):
        items = _rag_items(seed, float(family[5:]), 1.0)
    elif family == "mix":
        items = _system_items(seed + 1, kinds["system"] / n) + _rag_items(
            seed + 2, 1.0, kinds["rag"] / n
        )
    else:
        raise ValueError(f"{family!r} is not drawn from a fixed popularity")
    sys_items = [i for i in items if i.groups[0] < 2 << 40]
    rag_items = [i for i in items if i.groups[0] >= 2 << 40]
    for r in trace:
        kind, meta = r.meta["family"], r.meta
        if kind == "system":
            it = sys_items[meta["prompt"]]
        elif kind == "rag":
            it = rag_items[meta["doc"]]
        else:
            continue
        if r.groups[: len(it.groups)] != it.groups:
            raise AssertionError(f"the trace does not match the generator's items ({family})")
    return items


def _chunk_probs(
    items: Sequence[Item], cfg: SimConfig
) -> tuple[dict[Hashable, float], dict[Hashable, float], dict[Hashable, Hashable | None]]:
    """Per chunk key: probability that a request contains it, prefill seconds, parent."""
    prob: dict[Hashable, float] = {}
    secs: dict[Hashable, float] = {}
    parent: dict[Hashable, Hashable | None] = {}
    for it in items:
        req = Request(0.0, it.groups, [256] * len(it.groups), 0)
        for key, info in chunk_chain(req, cfg.kv_bytes_per_token):
            prob[key] = prob.get(key, 0.0) + it.prob
            secs[key] = cfg.cost.chunk_seconds(info.start_token, info.tokens)
            parent[key] = info.parent
    return prob, secs, parent


def expected_bound(items: Sequence[Item], cfg: SimConfig, chunk_bytes: int) -> float:
    """Largest expected prefill seconds saved per request by any fixed content, relaxed
    (fractional, no prefix constraint): an upper bound on any online policy's expected
    saving per request under independent requests."""
    prob, secs, _ = _chunk_probs(items, cfg)
    vals = sorted((prob[k] * secs[k] for k in prob), reverse=True)
    room = cfg.capacity_bytes / chunk_bytes
    whole = min(int(room), len(vals))
    frac = vals[whole] * (room - whole) if whole < len(vals) else 0.0
    return sum(vals[:whole]) + frac


class A0Content(StaticOracle):
    """A fixed content chosen greedily from the true probabilities (``StaticOracle``'s
    packing, by probability x prefill seconds per byte instead of the trace's counts)."""

    name = "a0"

    def __init__(self, items: Sequence[Item], cfg: SimConfig, chunk_bytes: int) -> None:
        prob, secs, parent = _chunk_probs(items, cfg)
        keep: set[Hashable] = set()
        used = 0
        for key in sorted(prob, key=lambda k: -prob[k] * secs[k]):
            bundle = []
            k: Hashable | None = key
            while k is not None and k not in keep:
                bundle.append(k)
                k = parent[k]
            if used + chunk_bytes * len(bundle) <= cfg.capacity_bytes:
                keep.update(bundle)
                used += chunk_bytes * len(bundle)
        self.keep = frozenset(keep)

    def moments(self, items: Sequence[Item], cfg: SimConfig) -> tuple[float, float]:
        """Mean and variance of the prefill seconds this content saves per request (the
        content in place, independent requests)."""
        mean = sq = 0.0
        for it in items:
            req = Request(0.0, it.groups, [256] * len(it.groups), 0)
            s = 0.0
            for key, info in chunk_chain(req, cfg.kv_bytes_per_token):
                if key not in self.keep:
                    break
                s += cfg.cost.chunk_seconds(info.start_token, info.tokens)
            mean += it.prob * s
            sq += it.prob * s * s
        return mean, sq - mean * mean


def hindsight_bound(trace: Sequence[Request], cfg: SimConfig) -> float:
    """Largest saving of any fixed content on ``trace`` itself, relaxed: the top chunks
    by ``(requests - 1) x`` prefill seconds per byte, fractionally, no prefix
    constraint."""
    count: dict[Hashable, int] = {}
    secs: dict[Hashable, float] = {}
    size: dict[Hashable, int] = {}
    for r in trace:
        for key, info in chunk_chain(r, cfg.kv_bytes_per_token):
            count[key] = count.get(key, 0) + 1
            secs[key] = cfg.cost.chunk_seconds(info.start_token, info.tokens)
            size[key] = info.nbytes
    ranked = sorted(((count[k] - 1) * secs[k], size[k]) for k in count if count[k] > 1)
    room, total = float(cfg.capacity_bytes), 0.0
    for value, nbytes in reversed(ranked):
        take = min(1.0, room / nbytes)
        total += value * take
        room -= nbytes * take
        if room <= 0:
            break
    return total


def row(family: str, seed: int, fraction: float) -> dict[str, float]:
    """Every reference for one cell, as a gain over the best baseline (0.1 = +10%)."""
    trace = generate(family, seed)
    kv = SimConfig(capacity_bytes=0).kv_bytes_per_token
    cfg = SimConfig(capacity_bytes=int(working_set_bytes(trace, kv) * fraction))
    chunk_bytes = 256 * kv
    items = items_of(family, seed, trace)
    best = max(simulate(trace, p, cfg).compute_s_saved for p in BASELINES)
    a0 = A0Content(items, cfg, chunk_bytes)
    mean, var = a0.moments(items, cfg)
    n = len(trace)
    out = {
        "best": best,
        "cost": simulate(trace, "cost", cfg).compute_s_saved,
        "static": simulate(trace, StaticOracle(trace, cfg), cfg).compute_s_saved,
        "a0": simulate(trace, a0, cfg).compute_s_saved,
        "e_a0": n * mean,
        "e_bound": n * expected_bound(items, cfg, chunk_bytes),
        "hindsight": hindsight_bound(trace, cfg),
    }
    gains = {k: v / best - 1.0 for k, v in out.items() if k != "best"}
    gains["sd"] = math.sqrt(n * var) / best
    gains["best"] = best
    return gains


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="mix")
    ap.add_argument("--capacity", default="0.1,0.25,0.5", help="fractions of the working set")
    ap.add_argument("--seeds", default="0,1,2,3")
    args = ap.parse_args()
    cols = ("cost", "static", "a0", "e_a0", "sd", "e_bound", "hindsight")
    print("| family | tier size | seed | best baseline (compute-s) | " + " | ".join(cols) + " |")
    print("|---|---|---|---|" + "---|" * len(cols))
    for frac in (float(x) for x in args.capacity.split(",")):
        for seed in (int(x) for x in args.seeds.split(",")):
            g = row(args.family, seed, frac)
            cells = " | ".join(
                f"±{100 * g[c]:.1f}%" if c == "sd" else f"{100 * g[c]:+.1f}%" for c in cols
            )
            print(
                f"| {args.family} | {frac:.0%} | {seed} | {g['best']:.1f} | {cells} |", flush=True
            )


if __name__ == "__main__":
    main()
