"""Placement policies: small cases computed by hand (docs/placement.md)."""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest

from lmcache_core.placement import (
    ARCPolicy,
    ChunkInfo,
    CostAwarePolicy,
    LRUPolicy,
    PlacementPolicy,
    PrefillCost,
    S3FIFOPolicy,
    victim_selector,
)

MB = 1 << 20


def info(parent: object = None, pos: int = 0, nbytes: int = MB, tokens: int = 256) -> ChunkInfo:
    return ChunkInfo(parent, pos, nbytes, tokens, pos * tokens)


def test_every_policy_satisfies_the_protocol() -> None:
    for p in (LRUPolicy(), ARCPolicy(4), S3FIFOPolicy(10), CostAwarePolicy(4 * MB)):
        assert isinstance(p, PlacementPolicy)


def test_lru_evicts_least_recent_and_skips_excluded() -> None:
    p = LRUPolicy()
    for k in "abc":
        p.inserted(k, info())
    p.record_access("a", info(), hit=True)
    assert p.victim() == "b"
    assert p.victim({"b"}) == "c"
    p.removed("b")
    assert p.victim() == "c"
    p.record_access("zz", info(), hit=False)  # a miss changes nothing
    assert p.victim() == "c"


def test_arc_moves_reused_to_t2_and_adapts_p_on_ghost_hits() -> None:
    p = ARCPolicy(2)
    p.inserted("a", info())
    p.inserted("b", info())
    p.record_access("a", info(), hit=True)  # a: T1 -> T2
    assert list(p.t1) == ["b"] and list(p.t2) == ["a"]
    assert p.victim() == "b"  # |T1| = 1 > p = 0
    p.removed("b")
    assert list(p.b1) == ["b"]
    p.record_access("b", info(), hit=False)  # ghost hit in B1: p += max(|B2|/|B1|, 1) = 1
    assert p.p == 1.0
    p.inserted("b", info())  # a ghost comes back into T2
    assert list(p.t2) == ["a", "b"] and not p.b1
    assert p.victim() == "a"  # T1 empty: LRU of T2
    p.removed("a")
    p.record_access("a", info(), hit=False)  # ghost hit in B2: p -= max(|B1|/|B2|, 1)
    assert p.p == 0.0


def test_s3fifo_filters_one_hit_chunks_through_the_small_queue() -> None:
    p = S3FIFOPolicy(10)  # small queue target: 1
    p.inserted("a", info())
    p.inserted("b", info())
    assert p.victim() == "a"  # small over target, a never re-accessed
    p.record_access("a", info(), hit=True)
    # a was re-accessed: it moves to main; small is back at target, main's head (a,
    # its frequency reset on the move) is the victim.
    assert p.victim() == "a"
    assert list(p.main) == ["a"] and list(p.small) == ["b"]
    p.removed("b")  # leaving small: remembered as a ghost
    assert "b" in p.ghost
    p.inserted("b", info())  # a ghost re-enters straight into main
    assert list(p.main) == ["a", "b"]
    p.record_access("a", info(), hit=True)
    assert p.victim() == "b"  # a had frequency 1: reinserted with 0, b goes


def test_prefill_cost_by_hand_and_fit() -> None:
    c = PrefillCost(tokens_per_s=1000.0, attn_tokens=1000.0)
    assert c.chunk_seconds(0, 1) == pytest.approx(0.001)
    assert c.chunk_seconds(1000, 2) == pytest.approx(2 * (1 + 1000.5 / 1000) / 1000)
    assert c.prompt_seconds(3) == pytest.approx(c.chunk_seconds(0, 2) + c.chunk_seconds(2, 1))
    samples = [(n, c.prompt_seconds(n)) for n in (128, 1024, 4096, 16384)]
    fitted = PrefillCost.fit(samples)
    assert fitted.tokens_per_s == pytest.approx(1000.0, rel=1e-6)
    assert fitted.attn_tokens == pytest.approx(1000.0, rel=1e-6)
    with pytest.raises(ValueError, match="two or more"):
        PrefillCost.fit([(100, 1.0), (100, 1.1)])
    with pytest.raises(ValueError):
        PrefillCost(tokens_per_s=0)


def test_cost_aware_value_grows_with_position_and_shrinks_with_load_time() -> None:
    p = CostAwarePolicy(100 * MB, PrefillCost(1000.0, 1000.0), bandwidth=1e12)
    early, late = info(None, 0), info(None, 10)
    for _ in range(2):  # reused once: its own history counts
        p.record_access("e", early, hit=False)
        p.record_access("l", late, hit=False)
    assert p.expected_hits("e", early) > 0
    # two accesses each (the later one a step fresher): saved seconds 0.256*(1+127.5/1000)
    # versus 0.256*(1+2687.5/1000)
    assert p.value("l", late) > 3 * p.value("e", early)
    slow = CostAwarePolicy(100 * MB, PrefillCost(1000.0, 1000.0), bandwidth=1.0)
    slow.record_access("e", early, hit=False)
    slow.record_access("e", early, hit=False)
    assert slow.value("e", early) == 0.0  # loading takes longer than recomputing


def test_cost_aware_never_evicts_a_chunk_before_its_resident_child() -> None:
    p = CostAwarePolicy(3 * MB)
    a, b = info(None, 0), info("a", 1)
    c = info(None, 0)
    for _ in range(5):
        p.record_access("b", b, hit=True)  # b is hot, a is barely seen
    p.record_access("a", a, hit=True)
    p.record_access("c", c, hit=True)
    p.record_access("c", c, hit=True)
    for k, i in (("a", a), ("b", b), ("c", c)):
        p.inserted(k, i)
    # a has the least value, but b (a's child) is resident: leaves are b and c; c is
    # worth less than b.
    assert p.victim() == "c"
    assert p.victim({"c"}) == "b"
    p.removed("b")
    assert p.victim() == "a"  # a is a leaf again and the cheapest


def test_cost_aware_admission_needs_the_parent_and_beats_the_victim() -> None:
    p = CostAwarePolicy(2 * MB, adapt=False)
    root, child = info(None, 0), info("r", 1)
    assert not p.admit("x", info("missing", 1))  # unreachable: parent not resident
    for _ in range(3):
        p.record_access("r", root, hit=False)
    assert p.admit("r", root)  # room left: admitted
    p.inserted("r", root)
    p.record_access("c", child, hit=False)
    p.inserted("c", child)
    # Full now. A one-off chunk seen once is worth less than the victim (c, seen once
    # earlier but deeper in its prompt): refused.
    one_off = info(None, 0)
    p.record_access("o", one_off, hit=False)
    assert p.victim() == "c"
    assert not p.admit("o", one_off)
    # Seen many times, the same chunk beats c.
    for _ in range(10):
        p.record_access("o", one_off, hit=False)
    assert p.admit("o", one_off)


def test_cost_aware_prefix_share_for_new_children() -> None:
    p = CostAwarePolicy(100 * MB, adapt=False, half_life=1e9)
    parent = info(None, 0)
    p.record_access("p", parent, hit=False)
    for i in range(4):
        p.record_access(f"c{i}", info("p", 1), hit=False)
    for _ in range(7):
        p.record_access("p", parent, hit=False)
    # p: 8 accesses, 4 distinct children -> a new child inherits about 8/4 = 2 accesses.
    p.record_access("new", info("p", 1), hit=False)  # the fifth child: 8/5
    assert p.expected_hits("new", info("p", 1)) == pytest.approx(8 / 5, rel=1e-3)
    assert p.expected_hits("c0", info("p", 1)) == pytest.approx(8 / 5, rel=1e-3)


def test_victim_selector_returns_only_candidates_in_policy_order() -> None:
    p = LRUPolicy()
    for k in "abcd":
        p.inserted(k, info())
    select = victim_selector(p, max_victims=2)
    assert select(["d", "c", "a"], MB) == ["a", "c"]  # b is pinned: not a candidate
    assert select([], MB) == []
    assert victim_selector(p)(["d"], MB) == ["d"]


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        ARCPolicy(0)
    with pytest.raises(ValueError):
        S3FIFOPolicy(0)
    with pytest.raises(ValueError):
        CostAwarePolicy(MB, bandwidth=0)
    with pytest.raises(ValueError):
        CostAwarePolicy(MB, half_life=-1)


def test_cost_aware_own_history_counts_from_the_first_reuse() -> None:
    p = CostAwarePolicy(100 * MB, adapt=False, half_life=1e9)
    alone = info(None, 0)
    p.record_access("k", alone, hit=False)
    assert p.expected_hits("k", alone) == 0.0  # seen once: no evidence of reuse yet
    p.record_access("k", alone, hit=False)
    assert p.expected_hits("k", alone) == pytest.approx(2.0, rel=1e-6)
    eager = CostAwarePolicy(100 * MB, adapt=False, half_life=1e9, min_reuse=1)
    eager.record_access("k", alone, hit=False)
    assert eager.expected_hits("k", alone) == pytest.approx(1.0, rel=1e-6)


def test_cost_aware_memory_follows_the_workload() -> None:
    """Stationary popularity (RAG) switches the policy to its long memory; chats whose
    chunks come back a few times and then never keep it on the short one."""
    from lmcache_core.placement import SimConfig, simulate
    from lmcache_core.placement.simulator import working_set_bytes
    from lmcache_core.placement.traces import multi_turn_trace, rag_trace

    for trace, long_memory in (
        (rag_trace(n_requests=2000, seed=5, n_docs=300), True),
        (multi_turn_trace(seed=5, n_sessions=100), False),
    ):
        cfg = SimConfig(working_set_bytes(trace, 131072) // 4)
        p = CostAwarePolicy(cfg.capacity_bytes, chunk_bytes_hint=256 * 131072)
        simulate(trace, p, cfg)
        assert p.long_memory is long_memory
    fixed = CostAwarePolicy(64 * MB, adapt=False)
    simulate(rag_trace(n_requests=2000, seed=5, n_docs=300), fixed, SimConfig(64 * MB))
    assert fixed.long_memory is False


def test_cost_aware_victims_stay_right_across_heap_rebuilds() -> None:
    # Touching the current victim each round re-values it lazily: the heap grows until
    # it is rebuilt; the victim must stay the least valuable resident leaf throughout.
    p = CostAwarePolicy(64 * MB, adapt=False, half_life=1e9, min_reuse=1)
    infos: dict[Hashable, ChunkInfo] = {f"k{i}": info(None, 0) for i in range(20)}
    for k, i in infos.items():
        p.inserted(k, i)
    for _ in range(3000):
        v = p.victim()
        assert v is not None
        cheapest = min(p.value(k, i) for k, i in infos.items())
        assert p.value(v, infos[v]) == pytest.approx(cheapest)
        other = p.victim({v})
        assert other is not None and other != v
        p.record_access(v, infos[v], hit=True)
    assert len(p._heap) <= 4 * 20 + 1024 + 1  # rebuilt on the way


def test_cost_aware_pushes_inserted_chunks_at_the_next_lookup() -> None:
    # A prompt's missing chunks are inserted in chain order, each one a parent right
    # after: they go onto the heap at the next lookup, and only those still leaves then.
    p = CostAwarePolicy(100 * MB, adapt=False, half_life=1e9)
    chain = [("a", info(None, 0)), ("b", info("a", 1)), ("c", info("b", 2))]
    p.record_accesses([k for k, _ in chain], [i for _, i in chain], [False] * 3)
    for k, i in chain:
        p.inserted(k, i)
    assert p._heap == []  # nothing pushed yet
    one_off = info(None, 0)
    p.record_access("x", one_off, hit=False)  # the next lookup: "c" alone is pushed
    assert [e[2].key for e in p._heap] == ["c"]
    p.inserted("x", one_off)  # worth nothing, but inserted since the latest lookup
    assert p.victim() == "c"  # not a candidate until the next lookup
    p.record_access("c", chain[2][1], hit=True)
    p.record_access("c", chain[2][1], hit=True)
    assert p.victim() == "x"  # pushed by that lookup, and the cheapest
    p.removed("x")
    p.removed("c")
    # a chunk inserted since the latest lookup is still found when nothing else is
    p.inserted("y", one_off)
    assert p.victim({"b"}) == "y"
    assert p.victim() in ("b", "y")


def _access_three_times(p: CostAwarePolicy, key: str, batched: bool) -> None:
    for _ in range(3):
        if batched:
            p.record_accesses([key], [info(None, 0)], [False])
        else:
            p.record_access(key, info(None, 0), hit=False)


def test_cost_aware_keeps_reuse_statistics_only_with_the_short_memory() -> None:
    # Holding is decided with the short memory only: with the long one in use the reuse
    # distances are not recorded (per-call and batched forms alike).
    for batched in (False, True):
        p = CostAwarePolicy(100 * MB)
        _access_three_times(p, "a", batched)
        assert p._reuses == 2 and sum(p._class_acc) == 3
        p._switch(True)
        _access_three_times(p, "a", batched)
        assert p._reuses == 2 and sum(p._class_acc) == 3


def _loop_then_fill(pick: list[str], hold: bool) -> tuple[CostAwarePolicy, list[str]]:
    """Accesses in the order ``pick``; then the 10 keys accessed longest ago (among the
    last 200 accesses) fill the 10-chunk tier."""
    p = CostAwarePolicy(10 * MB, hold=hold, chunk_bytes_hint=MB)
    for k in pick:
        p.record_access(k, info(None, 0), hit=False)
    last: dict[str, int] = {k: i for i, k in enumerate(pick)}
    oldest = sorted((i, k) for k, i in last.items())[:10]
    resident = [k for _, k in oldest]
    for k in resident:
        p.inserted(k, info(None, 0))
    return p, resident


def test_cost_aware_holds_a_chunk_whose_reuse_comes_after_a_bounded_wait() -> None:
    """200 keys in a loop (each back exactly 200 accesses later) through a 10-chunk tier:
    a resident key 190 accesses into its wait is due back sooner than the key just
    accessed, so it is held (the newcomer is refused); LRU-like recency (hold off)
    would displace it, and keys drawn at random (memoryless waits) hold nothing."""
    loop = [f"k{i % 200}" for i in range(4000)]
    p, resident = _loop_then_fill(loop, hold=True)
    newcomer = loop[-1]
    assert newcomer not in resident
    assert p.admit(newcomer, info(None, 0)) is False
    q, _ = _loop_then_fill(loop, hold=False)
    assert q.admit(newcomer, info(None, 0)) is True
    rng = random.Random(1)
    drawn = [f"k{rng.randrange(200)}" for _ in range(4000)]
    r, resident = _loop_then_fill(drawn, hold=True)
    assert drawn[-1] not in resident
    assert r.admit(drawn[-1], info(None, 0)) is True
    with pytest.raises(ValueError):
        CostAwarePolicy(MB, hold_margin=0)
