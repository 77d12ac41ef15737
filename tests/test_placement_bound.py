"""The upper bound on prefill compute saved (``lmcache-core simulate --bound``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lmcache_core.cli.main import main
from lmcache_core.placement import SimConfig, generate, simulate
from lmcache_core.placement.bound import prefill_bound
from lmcache_core.placement.oracle import BeladyOracle
from lmcache_core.placement.simulator import working_set_bytes
from lmcache_core.placement.traces import Request

KVB = 131072
CHUNK = 256 * KVB


def req(t: float, *groups: int) -> Request:
    return Request(t, tuple(groups), (256,) * len(groups), 1)


def test_two_prompts_alternating_in_a_one_chunk_tier_bound_one_hit() -> None:
    # A B A B: one chunk of room; the best any policy does is keep A for its second
    # request (one hit); the linear program cannot do better either
    trace = [req(0, 1), req(1, 2), req(2, 1), req(3, 2)]
    cfg = SimConfig(CHUNK)
    one_hit = cfg.cost.chunk_seconds(0, 256)
    b = prefill_bound(trace, cfg, iterations=400)
    assert one_hit * 0.999 <= b.seconds <= one_hit * 1.02
    assert b.no_capacity_seconds == pytest.approx(2 * one_hit)
    assert b.intervals == 2
    # no room at all: nothing can be saved; unbounded room: every reuse
    assert prefill_bound(trace, SimConfig(0)).seconds == pytest.approx(0.0, abs=1e-9)
    assert prefill_bound(trace, SimConfig(4 * CHUNK)).seconds == pytest.approx(2 * one_hit)


def test_a_chunk_cannot_hit_without_its_parent() -> None:
    # [P, Q] twice with one chunk of room: keeping Q alone saves nothing (the lookup
    # stops at P); the best is P (one hit). Without the chain constraint the program would
    # keep Q (later in the prompt, worth more).
    trace = [req(0, 1, 2), req(1, 1, 2)]
    cfg = SimConfig(CHUNK)
    wp = cfg.cost.chunk_seconds(0, 256)
    wq = cfg.cost.chunk_seconds(256, 256)
    assert wq > wp
    b = prefill_bound(trace, cfg, iterations=400)
    assert wp * 0.999 <= b.seconds < wq  # the relaxation's optimum is (wp + wq) / 2
    assert b.seconds == pytest.approx((wp + wq) / 2, rel=0.02)


@pytest.mark.parametrize("family", ["system", "rag-a1.2", "multi-turn", "mix"])
def test_bound_is_above_every_policy_and_the_clairvoyant_one(family: str) -> None:
    trace = generate(family, 2)[:1200]
    ws = working_set_bytes(trace, KVB)
    for frac in (0.1, 0.5):
        cfg = SimConfig(int(ws * frac), KVB)
        saved = {p: simulate(trace, p, cfg).compute_s_saved for p in ("lru", "s3fifo", "cost")}
        saved["oracle"] = simulate(trace, BeladyOracle(trace, KVB), cfg).compute_s_saved
        b = prefill_bound(trace, cfg, target=max(saved.values()))
        assert b.seconds >= max(saved.values()) * (1 - 1e-9), (family, frac, saved, b)
        assert b.seconds <= b.uniform_seconds <= b.no_capacity_seconds * (1 + 1e-9)
        # and it is informative: within 25% of the best a policy achieved
        assert b.seconds <= 1.25 * max(saved.values()), (family, frac, saved, b)


def test_cli_bound_json_and_table(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "t.jsonl"
    lines = [{"arrival": i, "groups": [i % 3, 100 + i % 5], "output_length": 1} for i in range(60)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["simulate", "--trace", str(path), "--capacities", "0.5", "--bound", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (b,) = doc["bounds"]
    best = max(r["compute_s_saved"] for r in doc["rows"] if r["policy"] != "cost")
    assert b["bound_compute_s_saved"] >= best
    assert b["best_baseline_to_bound"] == pytest.approx(
        b["bound_compute_s_saved"] / best - 1, abs=1e-3
    )
    assert (
        main(["simulate", "--trace", str(path), "--capacities", "0.5", "--bound", "--table"]) == 0
    )
    out = capsys.readouterr().out
    assert "t.jsonl @ 50%: upper bound" in out and "above the best baseline" in out
    assert main(["simulate", "--trace", str(path), "--capacities", "0.5", "--json"]) == 0
    assert "bounds" not in json.loads(capsys.readouterr().out)


def test_bound_is_valid_whatever_the_prices() -> None:
    # even without steps (the uniform price only) the value bounds the policies
    trace = generate("rag-a0.8", 1)[:800]
    ws = working_set_bytes(trace, KVB)
    cfg = replace(SimConfig(0, KVB), capacity_bytes=ws // 4)
    b0 = prefill_bound(trace, cfg, iterations=0)
    b = prefill_bound(trace, cfg)
    best = max(simulate(trace, p, cfg).compute_s_saved for p in ("lru", "arc", "s3fifo", "cost"))
    assert b0.seconds >= b.seconds >= best
    assert b0.iterations == 0 and b.iterations > 0


def test_static_oracle_keeps_the_most_valuable_prefixes_and_never_evicts() -> None:
    from lmcache_core.placement.oracle import StaticOracle

    # [1, 2] three times and [3] twice, two chunks of room: the second chunk of [1, 2]
    # is worth most per byte (requested again twice, later in its prompt); it comes with
    # its parent, and [3] no longer fits
    trace = [req(0, 1, 2), req(1, 3), req(2, 1, 2), req(3, 3), req(4, 1, 2)]
    cfg = SimConfig(2 * CHUNK)
    oracle = StaticOracle(trace, cfg)
    assert len(oracle.keep) == 2
    r = simulate(trace, oracle, cfg)
    assert r.tokens_saved == 4 * 256  # both chunks hit in requests 2 and 4
    assert oracle.victim() is None
    # on a stationary trace it stays below the bound
    trace = generate("rag-a0.8", 1)[:800]
    cfg = SimConfig(working_set_bytes(trace, KVB) // 10, KVB)
    static = simulate(trace, StaticOracle(trace, cfg), cfg).compute_s_saved
    assert 0 < static <= prefill_bound(trace, cfg, target=static).seconds
