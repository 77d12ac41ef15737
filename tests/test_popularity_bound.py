"""benchmarks/popularity_bound.py: the generators' items are reconstructed exactly, and
the references are ordered as they must be (a relaxation is never below what it relaxes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import popularity_bound as pb  # noqa: E402

from lmcache_core.placement.oracle import StaticOracle  # noqa: E402
from lmcache_core.placement.simulator import (  # noqa: E402
    SimConfig,
    chunk_chain,
    simulate,
    working_set_bytes,
)
from lmcache_core.placement.traces import Request, generate  # noqa: E402

Mix = tuple[list[Request], SimConfig, list[pb.Item]]


@pytest.fixture(scope="module")
def mix() -> Mix:
    trace = generate("mix", 0)
    cfg = SimConfig(capacity_bytes=int(working_set_bytes(trace, 131072) * 0.1))
    return trace, cfg, pb.items_of("mix", 0, trace)


def test_items_match_the_trace_and_carry_the_reused_share(mix: Mix) -> None:
    trace, _, items = mix
    # 20 system prompts and 1,000 documents (items_of checked every request's prefix)
    assert len(items) == 1020
    reused = sum(r.meta["family"] != "scan" for r in trace) / len(trace)
    assert sum(i.prob for i in items) == pytest.approx(reused)
    assert reused == pytest.approx(0.8)


def test_a_family_not_drawn_from_a_popularity_is_refused() -> None:
    with pytest.raises(ValueError, match="fixed popularity"):
        pb.items_of("multi-turn", 0, generate("multi-turn", 0))


def test_the_relaxations_lie_above_what_they_relax(mix: Mix) -> None:
    trace, cfg, items = mix
    chunk = 256 * cfg.kv_bytes_per_token
    a0 = pb.A0Content(items, cfg, chunk)
    # the A0 content fits and is closed under prefixes (every kept chunk's parent kept)
    assert len(a0.keep) * chunk <= cfg.capacity_bytes
    for it in items:
        chain = chunk_chain(Request(0.0, it.groups, [256] * len(it.groups), 0), 131072)
        kept = [k in a0.keep for k, _ in chain]
        assert kept == sorted(kept, reverse=True)
    mean, var = a0.moments(items, cfg)
    assert var > 0
    assert pb.expected_bound(items, cfg, chunk) >= mean
    static = simulate(trace, StaticOracle(trace, cfg), cfg).compute_s_saved
    assert pb.hindsight_bound(trace, cfg) >= static
    assert pb.hindsight_bound(trace, cfg) >= simulate(trace, a0, cfg).compute_s_saved
