"""The trace readers, the four generators' parameters, the simulator and ``simulate``."""

from __future__ import annotations

import io
import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from lmcache_core.cli.main import main
from lmcache_core.placement import (
    CostAwarePolicy,
    PrefillCost,
    Request,
    SimConfig,
    TraceError,
    generate,
    read_trace,
    simulate,
)
from lmcache_core.placement.report import best_baseline_gain, run_grid
from lmcache_core.placement.simulator import working_set_bytes
from lmcache_core.placement.traces import (
    mix_trace,
    multi_turn_trace,
    rag_trace,
    system_prompt_trace,
)

KVB = 1024  # bytes per token in the small cases: a 256-token chunk is 256 KiB


def test_reads_mooncake_lines_and_trims_the_last_block() -> None:
    text = (
        '{"timestamp": 27482, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]}\n'
        "\n"
        '{"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [46, 48]}\n'
    )
    reqs = read_trace(io.StringIO(text))
    assert [r.arrival for r in reqs] == [0.0, 27.482]  # sorted, milliseconds -> seconds
    assert reqs[1].groups == [46, 47] and reqs[1].chunk_tokens == [512, 143]
    assert reqs[1].output_length == 52 and reqs[1].prompt_tokens == 655
    assert reqs[0].chunk_tokens == [512, 512]


def test_reads_own_format_groups_and_tokens() -> None:
    text = (
        '{"arrival": 1.5, "groups": [1, 2], "output_length": 3}\n'
        '{"arrival": 2.0, "tokens": [5, 6, 7, 8, 9]}\n'
        '{"arrival": 3.0, "tokens": [5, 6, 7, 8, 10]}\n'
    )
    a, b, c = read_trace(io.StringIO(text), chunk_tokens=4)
    assert a.groups == [1, 2] and a.chunk_tokens == [4, 4]
    assert b.chunk_tokens == [4, 1] and c.chunk_tokens == [4, 1]
    assert b.groups[0] == c.groups[0] and b.groups[1] != c.groups[1]  # shared first chunk


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"arrival": 1}', "needs 'groups'"),
        ('{"groups": [1, "x"]}', "list of integers"),
        ('{"groups": [1], "output_length": -1}', "output_length"),
        ('{"hash_ids": [1], "timestamp": "soon"}', "timestamp"),
    ],
)
def test_bad_lines_name_the_line(line: str, message: str) -> None:
    src = io.StringIO('{"groups": [1]}\n' + line + "\n")
    src.name = "t.jsonl"
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: .*{message}"):
        read_trace(src)


def _share_of_top(counts: Counter[int], n: int) -> float:
    return counts.most_common(1)[0][1] / n


def test_system_prompt_generator_parameters() -> None:
    trace = system_prompt_trace(n_requests=4000)
    prompts = Counter(r.meta["prompt"] for r in trace)
    assert len(prompts) == 20
    harmonic = sum(1 / k for k in range(1, 21))  # Zipf alpha=1.0 over 20 prompts
    assert _share_of_top(prompts, 4000) == pytest.approx(1 / harmonic, abs=0.03)
    assert prompts[0] > prompts[1] > prompts[5]  # rank 0 most popular


@pytest.mark.parametrize("alpha", [0.8, 1.2])
def test_rag_generator_parameters(alpha: float) -> None:
    trace = rag_trace(n_requests=6000, alpha=alpha)
    docs = Counter(r.meta["doc"] for r in trace)
    assert max(docs) < 1000
    norm = sum(1 / k**alpha for k in range(1, 1001))
    assert docs[0] / 6000 == pytest.approx(1 / norm, rel=0.2)
    assert all(r.groups[:2] == trace[0].groups[:2] for r in trace)  # shared instruction


def test_multi_turn_generator_parameters() -> None:
    trace = multi_turn_trace()
    assert len(trace) == 1000
    by_session: dict[int, list[Request]] = {}
    for r in trace:
        by_session.setdefault(r.meta["session"], []).append(r)
    assert len(by_session) == 200
    for turns in by_session.values():
        assert [t.meta["turn"] for t in turns] == [0, 1, 2, 3, 4]
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.groups[: len(prev.groups)] == prev.groups  # the history is re-sent
    assert [r.arrival for r in trace] == sorted(r.arrival for r in trace)


def test_mix_generator_has_a_fifth_one_off_scans() -> None:
    trace = mix_trace(n_requests=1000)
    fams = Counter(r.meta["family"] for r in trace)
    assert fams["scan"] == 200 and fams["system"] + fams["rag"] == 800
    scan_groups = [g for r in trace if r.meta["family"] == "scan" for g in r.groups]
    assert len(scan_groups) == len(set(scan_groups))  # one-off: never repeated


def test_families_are_deterministic_per_seed() -> None:
    a, b, c = generate("multi-turn", 1), generate("multi-turn", 1), generate("multi-turn", 2)
    assert [r.groups for r in a] == [r.groups for r in b] != [r.groups for r in c]
    with pytest.raises(ValueError, match="unknown trace family"):
        generate("nope")


def _req(t: float, groups: list[int]) -> Request:
    return Request(t, groups, [256] * len(groups))


def test_simulator_lru_by_hand() -> None:
    # Room for two chunks. r1 misses both; r2 hits both; r3 hits chunk 1, misses 3 and
    # stores it by evicting chunk 2 (chunk 1 is in use by r3).
    trace = [_req(0, [1, 2]), _req(1, [1, 2]), _req(2, [1, 3])]
    cost = PrefillCost(1000.0, 1e12)
    cfg = SimConfig(2 * 256 * KVB, KVB, bandwidth=256 * KVB * 10, cost=cost)  # 0.1 s/load
    r = simulate(trace, "lru", cfg)
    assert (r.chunks, r.hit_chunks, r.tokens_saved) == (6, 3, 768)
    assert r.compute_s_total == pytest.approx(6 * 0.256)
    assert r.compute_s_saved == pytest.approx(3 * 0.256)
    assert r.load_s == pytest.approx(0.3)
    # TTFTs: 0.512, 0.2 (two loads), 0.1 + 0.256
    assert r.ttft_mean_s == pytest.approx((0.512 + 0.2 + 0.356) / 3)
    assert r.ttft_p99_s == pytest.approx(0.512)
    assert r.compute_s_per_1k_tokens == pytest.approx(1000 * 3 * 0.256 / 1536)
    # A lookup stops at the first miss: with chunk 1 evicted, chunk 2 cannot be served.
    r = simulate([_req(0, [1, 2]), _req(1, [9]), _req(2, [1, 2])], "lru", cfg)
    assert r.hit_chunks == 0


def test_working_set_counts_chunks_used_twice() -> None:
    trace = [_req(0, [1, 2]), _req(1, [1, 3]), _req(2, [1, 2])]
    assert working_set_bytes(trace, KVB) == 2 * 256 * KVB  # chunks 1 and 1/2
    assert working_set_bytes(trace, KVB, min_uses=1) == 3 * 256 * KVB


def test_cost_aware_beats_the_baselines_on_system_prompts_at_ten_percent() -> None:
    cells = run_grid(
        {"system": system_prompt_trace(n_requests=1500)},
        [0.1],
        ["lru", "arc", "s3fifo", "cost"],
        SimConfig(0),
    )
    gain = best_baseline_gain(cells[0])
    assert gain is not None and gain >= 0.10


def test_cost_aware_holds_chats_and_beats_the_baselines_on_multi_turn_at_ten_percent() -> None:
    """The issue's bar on the multi-turn family (seed 0, tier at 10% of the working set):
    met with holding (chunks part of the way through their wait for the next turn are
    not displaced by newcomers), not without it."""
    trace = multi_turn_trace(seed=0)
    cells = run_grid({"multi-turn": trace}, [0.1], ["lru", "arc", "s3fifo", "cost"], SimConfig(0))
    gain = best_baseline_gain(cells[0])
    assert gain is not None and gain >= 0.10
    results = cells[0].results
    cfg = SimConfig(results["cost"].capacity_bytes)  # 256-token chunks of 32 MiB
    best = max(results[p].compute_s_saved for p in ("lru", "arc", "s3fifo"))
    no_hold = CostAwarePolicy(cfg.capacity_bytes, chunk_bytes_hint=256 * 131072, hold=False)
    assert simulate(trace, no_hold, cfg).compute_s_saved < 1.05 * best


def test_cli_simulate_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["simulate", "--family", "multi-turn", "--write-trace", str(trace)]) == 0
    capsys.readouterr()
    png = tmp_path / "p.png"
    args = [
        "simulate",
        "--trace",
        str(trace),
        "--policies",
        "lru,cost",
        "--capacities",
        "0.1,0.5",
        "--price-per-hour",
        "3.6",
        "--plot",
        str(png),
        "--json",
        "--oracle",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert {(r["policy"], r["capacity_fraction"]) for r in rows} == {
        ("lru", 0.1),
        ("lru", 0.5),
        ("cost", 0.1),
        ("cost", 0.5),
        ("oracle", 0.1),
        ("oracle", 0.5),
        ("static", 0.1),
        ("static", 0.5),
    }
    saved = {(r["policy"], r["capacity_fraction"]): r["compute_s_saved"] for r in rows}
    assert saved[("oracle", 0.1)] >= saved[("lru", 0.1)]  # it reads the future
    for r in rows:
        assert 0 <= r["hit_ratio"] <= 1 and r["trace"] == "t.jsonl"
        # price 3.6/h = 0.001 per compute-second
        assert r["price_per_1k_tokens"] == pytest.approx(
            r["compute_s_per_1k_tokens"] / 1000, abs=1e-6
        )
    big = [r for r in rows if r["capacity_fraction"] == 0.5]
    small = [r for r in rows if r["capacity_fraction"] == 0.1]
    assert sum(r["tokens_saved"] for r in big) > sum(r["tokens_saved"] for r in small)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_simulate_table_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"groups": [1, 2]}\n{"groups": [1, 2]}\n{"groups": [1, 3]}\n')
    assert main(["simulate", "--trace", str(trace), "--table", "--capacities", "1"]) == 0
    out = capsys.readouterr().out
    assert "hit_ratio" in out and "cost-aware vs best of lru/arc/s3fifo" in out
    assert main(["simulate", "--trace", str(trace), "--policies", "lru,bogus"]) == 2
    assert "unknown policy bogus" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["simulate", "--trace", str(bad)]) == 2
    assert "bad.jsonl:1: not JSON" in capsys.readouterr().err
    assert main(["simulate", "--write-trace", str(tmp_path / "x")]) == 2
    with pytest.raises(SystemExit):
        main(["simulate", "--capacities", "0,1"])


def test_belady_oracle_bounds_every_policy_and_refuses_out_of_order_replays() -> None:
    from lmcache_core.placement.oracle import BeladyOracle
    from lmcache_core.placement.simulator import SimConfig, simulate, working_set_bytes
    from lmcache_core.placement.traces import rag_trace

    trace = rag_trace(n_requests=800, seed=3, n_docs=150)
    cfg = SimConfig(working_set_bytes(trace, 131072) // 5)
    oracle = simulate(trace, BeladyOracle(trace, 131072), cfg)
    for name in ("lru", "arc", "s3fifo", "cost"):
        assert oracle.compute_s_saved >= simulate(trace, name, cfg).compute_s_saved, name
    with pytest.raises(ValueError, match="out of its trace's order"):
        simulate(trace[1:], BeladyOracle(trace, 131072), cfg)
