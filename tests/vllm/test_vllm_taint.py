"""BlockTaint: which blocks may hold wrong KV, followed through vLLM's block sharing."""

from __future__ import annotations

from lmcache_core.integrations.vllm.taint import BlockTaint

BS, BPC = 4, 2  # 4 tokens per block, 2 blocks per chunk


def test_a_failed_load_poisons_what_every_reader_wrote_then_a_clean_rewrite_cleans() -> None:
    t = BlockTaint(BS, BPC)
    # r1 loads blocks 10-13 (table indices 0-3) this step; r2 shares them (prefix hit).
    t.loading("r1", [(0, 10), (1, 11), (2, 12), (3, 13)], step=1)
    t.admit("r2", [10, 11, 12, 13, 20, 21], shared_blocks=4)
    assert t.holds("r1") and t.holds("r2")
    acc1 = t.access("r1", [10, 11, 12, 13, 30], computed=16, scheduled=4)
    acc2 = t.access("r2", [10, 11, 12, 13, 20, 21], computed=16, scheduled=8)
    t.record_step(1, [acc1, acc2])
    # Saves read the suspect blocks; the outcome is not known yet.
    assert sorted(t.save_reads("r2", 6) or []) == [10, 11, 12, 13]
    new = t.resolve_step(1, {12})  # block 12 (index 2) failed to load
    assert new >= {12, 20, 21, 30}  # both requests computed over it
    assert t.take_resets() == {"r1": 1, "r2": 1}
    assert t.save_reads("r2", 6) is None and t.save_reads("r2", 2) == []
    # r1 recomputes from block 12 while r2 reads it in the same step: the rewrite is
    # clean (each layer writes before it reads), so r2's rewrite of 20-21 is clean too.
    acc1 = t.access("r1", [10, 11, 12, 13, 30], computed=8, scheduled=12)
    acc2 = t.access("r2", [10, 11, 12, 13, 20, 21], computed=16, scheduled=8)
    t.record_step(2, [acc2, acc1])
    assert t.resolve_step(2, set()) == set()
    assert not t.poisoned and t.save_reads("r2", 6) == []


def test_partial_rewrites_and_fresh_blocks() -> None:
    t = BlockTaint(BS, BPC)
    t.loading("r", [(0, 5)], step=1)
    t.resolve_step(1, {5})
    assert t.poisoned == {5: 0}
    t.record_step(2, [t.access("r", [5], computed=0, scheduled=2)])
    assert t.poisoned == {5: 2}  # half rewritten
    assert t.save_reads("r", 1) is None
    t.record_step(3, [t.access("r", [5], computed=2, scheduled=2)])
    assert not t.poisoned
    # A poisoned block freed and allocated fresh to another request is clean for it.
    t.loading("q", [(0, 7)], step=4)
    t.resolve_step(4, {7})
    t.drop("q")
    t.fresh([7])
    assert not t.poisoned and not t.holders


def test_a_late_failure_report_propagates_through_steps_planned_meanwhile() -> None:
    """Asynchronous scheduling: step 2 is planned before step 1's failure is known."""
    t = BlockTaint(BS, BPC)
    t.loading("a", [(0, 1), (1, 2)], step=1)
    t.admit("b", [1, 2, 8], shared_blocks=2)
    t.record_step(1, [t.access("b", [1, 2, 8], computed=8, scheduled=2)])
    t.record_step(2, [t.access("b", [1, 2, 8, 9], computed=10, scheduled=6)])
    assert t.save_reads("b", 4) == [1, 2]  # planned in step 2: carries the suspects
    t.resolve_step(1, {2})
    assert {8, 9} <= set(t.poisoned)
    assert t.save_reads("b", 4) is None
    assert t.take_resets()["b"] == 0
    t.resolve_async("nobody", ())
    assert t.stats()["suspect_blocks"] == 0
