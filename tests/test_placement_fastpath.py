"""The cost-aware policy's fast paths decide exactly as before and as the per-chunk calls.

* the rewritten :class:`CostAwarePolicy` (one record per key) against the previous
  implementation (``tests/placement_reference.py``), call for call, on every generated
  trace family, including the rare paths (history forgotten, weights rescaled), with
  holding off (``hold=False``: the reference predates it; with it on, the policy
  refuses some admissions the reference makes, deliberately);
* the batched calls the hierarchy makes (``record_accesses`` per lookup, ``victim_in``
  per eviction) against the per-chunk calls (``record_access`` per key, ``victim`` asked
  again for every refused candidate), with some resident chunks not evictable (stores
  in flight), as on the hierarchy's path;
* a policy without the batched methods (a third party's) gets the per-chunk loops.
"""

from __future__ import annotations

import random
from collections.abc import Container, Hashable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import Any

import pytest
from placement_reference import ReferenceCostAwarePolicy

from lmcache_core.placement import (
    ChunkInfo,
    CostAwarePolicy,
    LRUPolicy,
    SimConfig,
    generate,
    simulate,
)
from lmcache_core.placement.base import record_accesses, victim_in
from lmcache_core.placement.simulator import chunk_chain, working_set_bytes

KVB = 131072


class PerChunk:
    """Hides a policy's batched methods: only the five per-chunk calls remain."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name

    def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
        self.inner.record_access(key, info, hit)

    def admit(self, key: Hashable, info: ChunkInfo) -> bool:
        return bool(self.inner.admit(key, info))

    def inserted(self, key: Hashable, info: ChunkInfo) -> None:
        self.inner.inserted(key, info)

    def removed(self, key: Hashable) -> None:
        self.inner.removed(key)

    def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
        return self.inner.victim(exclude)  # type: ignore[no-any-return]


def drive(policy: Any, trace: Sequence[Any], capacity: int, batched: bool) -> list[object]:
    """The hierarchy's pattern on a bounded tier, logging every decision.

    Per request: one access per chunk (hits: resident); then each missing chunk is asked
    for admission and, admitted, counts as resident at once (``TierPlacement.admits``)
    while its store is in flight; room is made by victims among the resident chunks that
    are not in flight (what the backend offers the selector). A third of the requests
    finish their stores only after the next request's (stores overlap)."""
    log: list[object] = []
    resident: dict[Hashable, int] = {}
    used = 0
    in_flight: set[Hashable] = set()
    rng = random.Random(7)

    class Evictable(Container[Hashable]):
        def __contains__(self, key: object) -> bool:
            return key in resident and key not in in_flight

    evictable = Evictable()
    for req in trace:
        chain = chunk_chain(req, KVB)
        keys = [k for k, _ in chain]
        infos = [i for _, i in chain]
        hits = [k in resident for k in keys]
        if batched:
            record_accesses(policy, keys, infos, hits)
        else:
            for k, i, h in zip(keys, infos, hits, strict=True):
                policy.record_access(k, i, h)
        done_now: list[Hashable] = []
        for key, info in chain:
            if key in resident:
                continue
            ok = policy.admit(key, info)
            log.append(("admit", key, ok))
            if not ok:
                continue
            resident[key] = info.nbytes
            used += info.nbytes
            in_flight.add(key)
            done_now.append(key)
            policy.inserted(key, info)
            while used > capacity:
                if batched:
                    v = victim_in(policy, evictable, 64)
                else:
                    v = victim_in(PerChunk(policy), evictable, 64)  # the per-chunk loop
                log.append(("victim", v))
                if v is None:
                    break
                used -= resident.pop(v)
                policy.removed(v)
        if rng.random() < 0.67:
            in_flight.clear()
        else:
            in_flight.difference_update(done_now[: len(done_now) // 2])
    return log


def cut(family: str, n: int, seed: int = 0) -> tuple[list[Any], int]:
    trace = generate(family, seed)[:n]
    return trace, working_set_bytes(trace, KVB)


FAMILIES = ["system", "rag-a0.8", "rag-a1.2", "multi-turn", "mix"]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_calls_decide_as_the_per_chunk_calls(family: str) -> None:
    trace, ws = cut(family, 900)
    cap = ws // 10
    a = drive(CostAwarePolicy(cap, chunk_bytes_hint=256 * KVB), trace, cap, batched=True)
    b = drive(CostAwarePolicy(cap, chunk_bytes_hint=256 * KVB), trace, cap, batched=False)
    assert a == b
    victims = [x for x in a if x[0] == "victim"]
    assert len(victims) > 100  # evictions happened
    assert any(x[2] is False for x in a if x[0] == "admit")  # and refusals


@pytest.mark.parametrize(
    "options",
    [
        {"history": 64},  # keys forgotten inside lookups (the batched form's general loop)
        {"history": 64, "hold": False},  # (its loop for the usual state until the first)
        {"half_life": 4.0},  # weights rescaled inside lookups
        {"judge_every": 1},  # a vote on every access
        {"judge_every": 0},  # (as 1)
        {"judge_every": 3, "switch_at": 1.0},  # votes mid-lookup, memories switching
        {"judge_every": 2, "switch_at": 1.0},  # (switches inside lookups, both ways)
    ],
    ids=[
        "small-history",
        "small-history-no-hold",
        "rescale",
        "judge-1",
        "judge-0",
        "judge-3",
        "judge-2",
    ],
)
def test_batched_calls_decide_as_the_per_chunk_calls_on_the_rare_paths(
    options: dict[str, Any],
) -> None:
    for family in ("rag-a0.8", "multi-turn"):
        trace, ws = cut(family, 400)
        cap = ws // 10
        pa = CostAwarePolicy(cap, chunk_bytes_hint=256 * KVB, **options)
        pb = CostAwarePolicy(cap, chunk_bytes_hint=256 * KVB, **options)
        assert drive(pa, trace, cap, True) == drive(pb, trace, cap, False), (family, options)
        # and the same history: which keys are remembered, how often accessed, how recently
        keys = {k for req in trace for k, _ in chunk_chain(req, KVB)}
        assert {k: pa.access_count(k) for k in keys} == {k: pb.access_count(k) for k in keys}
        order = [r.key for r in sorted(pa._hist_list, key=lambda r: r.stamp)]
        assert order == [r.key for r in sorted(pb._hist_list, key=lambda r: r.stamp)]
        # and the same reuse statistics (recorded only while the short memory is in use:
        # a switch inside a lookup must stop or start them at the same access)
        assert (pa._reuse_hist, pa._class_acc, pa._reuses) == (
            pb._reuse_hist,
            pb._class_acc,
            pb._reuses,
        ), (family, options)


@pytest.mark.parametrize("family", FAMILIES)
def test_rewritten_policy_decides_as_the_previous_one(family: str) -> None:
    trace, ws = cut(family, 900)
    cap = ws // 10
    new = drive(
        CostAwarePolicy(cap, chunk_bytes_hint=256 * KVB, hold=False), trace, cap, batched=True
    )
    ref = drive(ReferenceCostAwarePolicy(cap, chunk_bytes_hint=256 * KVB), trace, cap, False)
    assert new == ref


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"history": 64},  # keys forgotten all along
        {"half_life": 4.0},  # weights rescaled every ~2,700 accesses
        {"adapt": False, "min_reuse": 1},
        {"latency_s": 0.02},  # loads cost more than the early chunks save
    ],
    ids=["default", "small-history", "rescale", "no-adapt", "slow-tier"],
)
def test_same_simulated_results_as_the_previous_policy(options: dict[str, Any]) -> None:
    for family in ("rag-a0.8", "multi-turn", "mix"):
        trace, ws = cut(family, 1500, seed=1)
        for frac in (0.1, 0.5):
            cfg = SimConfig(int(ws * frac), KVB)
            new = CostAwarePolicy(
                cfg.capacity_bytes,
                cfg.cost,
                cfg.bandwidth,
                chunk_bytes_hint=256 * KVB,
                hold=False,
                **options,
            )
            ref = ReferenceCostAwarePolicy(
                cfg.capacity_bytes, cfg.cost, cfg.bandwidth, chunk_bytes_hint=256 * KVB, **options
            )
            got = simulate(trace, new, cfg)
            want = simulate(trace, ref, cfg)
            assert replace(got, policy="x") == replace(want, policy="x"), (family, frac)
            assert got.hit_chunks > 0
            assert new.long_memory == ref.long_memory
    if "history" in options:
        assert len(new._hist_list) <= 64 + len(new._res)


def test_a_policy_without_batched_methods_gets_the_per_chunk_loops() -> None:
    calls: list[tuple[str, object]] = []

    class Plain(LRUPolicy):
        def record_access(self, key: Hashable, info: ChunkInfo, hit: bool) -> None:
            calls.append(("access", key))
            super().record_access(key, info, hit)

        def victim(self, exclude: AbstractSet[Hashable] = frozenset()) -> Hashable | None:
            v = super().victim(exclude)
            calls.append(("victim", v))
            return v

    p = Plain()
    infos = [ChunkInfo(None, 0, 1, 1, 0)] * 3
    for k in "abc":
        p.inserted(k, infos[0])
    record_accesses(p, ["a", "b", "c"], infos, [True, True, True])
    assert calls == [("access", "a"), ("access", "b"), ("access", "c")]
    calls.clear()
    # "a" and "b" (least recent first) are not evictable: asked again, excluding them
    assert victim_in(p, {"c"}, 64) == "c"
    assert calls == [("victim", "a"), ("victim", "b"), ("victim", "c")]
    calls.clear()
    assert victim_in(p, {"c"}, 2) is None  # looked at no more than the limit
    assert calls == [("victim", "a"), ("victim", "b")]
    with pytest.raises(ValueError):
        record_accesses(p, ["a"], infos, [True])  # lengths must agree


def test_victim_in_matches_victim_with_exclusions_on_the_cost_policy() -> None:
    p = CostAwarePolicy(6 << 20, chunk_bytes_hint=1 << 20)
    parent = None
    for i in range(6):
        k = f"k{i}"
        inf = ChunkInfo(parent if i % 2 else None, i % 2, 1 << 20, 256, (i % 2) * 256)
        p.record_access(k, inf, False)
        p.inserted(k, inf)
        parent = k
    order = []
    seen: set[Hashable] = set()
    while (v := p.victim(seen)) is not None:
        order.append(v)
        seen.add(v)
    assert len(order) == 3  # the leaves only (k1, k3, k5)
    assert p.victim_in(set(order[1:]), 64) == order[1]
    assert p.victim_in({order[2]}, 2) is None  # the limit counts refused candidates
    assert p.victim_in({order[2]}, 3) == order[2]
    assert p.victim_in(set(), 64) is None


def test_tier_placement_batches_agreeing_lookups_and_corrects_the_others() -> None:
    from lmcache_core.placement.wiring import ChainBook, TierPlacement

    calls: list[tuple[object, ...]] = []

    class Batched(LRUPolicy):
        def record_accesses(
            self, keys: Sequence[Hashable], infos: Sequence[ChunkInfo], hits: Sequence[bool]
        ) -> None:
            calls.append(("batch", tuple(keys), tuple(hits), tuple(i.position for i in infos)))
            for k, i, h in zip(keys, infos, hits, strict=True):
                self.record_access(k, i, h)

        def inserted(self, key: Hashable, info: ChunkInfo) -> None:
            calls.append(("inserted", key))
            super().inserted(key, info)

        def removed(self, key: Hashable) -> None:
            calls.append(("removed", key))
            super().removed(key)

    book = ChainBook(chunk_tokens=16)
    tp = TierPlacement(Batched(), book, 100, chooses_victims=True)
    book.learn(["a", "b", "c"])
    tp.looked_up(["a", "b", "c"], [False, False, False])  # agrees: nothing is resident
    assert calls == [("batch", ("a", "b", "c"), (False, False, False), (0, 1, 2))]
    calls.clear()
    assert tp.admits("a", 100) and tp.admits("b", 100)
    assert calls == [("inserted", "a"), ("inserted", "b")]
    calls.clear()
    # "b" is gone (another process, a failed store), "c" appeared: key by key, in order
    tp.looked_up(["a", "b", "c"], [True, False, True])
    assert calls == [("removed", "b"), ("inserted", "c")]
    calls.clear()
    tp.looked_up(["a", "b", "c"], [True, False, True])  # agrees again: one batch
    assert calls == [("batch", ("a", "b", "c"), (True, False, True), (0, 1, 2))]
    # victims: a policy without victim_in is asked again for each refused candidate
    select = tp.selector()
    assert select(["c"], 0) == ["c"]  # "a" (least recent) is not evictable
    assert select([], 0) == []
    tp.removed("a")
    assert calls[-1] == ("removed", "a")
