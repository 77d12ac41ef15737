"""A slow shared tier never stalls the engine (real engine, in-process).

The only tier is a disk tier whose lookups, loads and stores are delayed at will
(``kv_test_backends.SlowDiskBackend``). With 20 ms added to lookups and 2 s to loads, a
request that hits it waits for its KV in the background while a concurrent request keeps
decoding at its usual pace; with 2 s added to lookups the hit is given up (a miss,
counted as a lookup deadline). Also: an abort while a request waits for its KV, another
process evicting from the tier between lookup and load (the pinned chunks survive), and a
shutdown with stores pending.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest
import vllm_cases as c
from conftest import EngineRun, Models, connector_config, engine_env, requires_vllm, run_engine

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

DECODE_TOKENS = 300
DISK_BYTES = 32 * 64 * 1024  # 32 chunks
CHUNK_SHAPE = [2, 2, 2, 32, 64]  # the test model's chunk: layers, blocks, heads, tokens, K|V
# the issue asks for at least a median of 3; single pairs on this 2-core machine range
# 0.8-1.22x around a median of ~1.03x (a CI run once drew 1.12x from 5 pairs), so 9
# pairs, each slow run compared with the baseline just before it, after a warm-up run
REPEATS = 9
SLOW = {"lookup_delay_s": 0.02, "get_delay_s": 2.0}


def _gen(name: str, *prompts: list[int], **kw: Any) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompts": [{"tokens": p} for p in prompts], **kw}


def _itl(name: str, concurrent: list[list[int]]) -> dict[str, Any]:
    return {
        "op": "itl",
        "name": name,
        "decode": {"tokens": c.DECODER},
        "decode_tokens": DECODE_TOKENS,
        "concurrent": [{"tokens": p} for p in concurrent],
        "start_after": 20,
    }


@pytest.fixture(scope="module")
def e9(vllm_models: Models, tmp_path_factory: pytest.TempPathFactory) -> EngineRun:
    work = tmp_path_factory.mktemp("vllm_slow")
    disk, stats, control = work / "disk", work / "stats", work / "control.json"
    control.write_text("{}")
    storage = {
        "chunk_size": c.CHUNK,
        "drain_timeout_s": 1.0,
        "tiers": [
            {
                "name": "slowdisk",
                "backend_class": "kv_test_backends:SlowDiskBackend",
                "options": {"path": str(disk), "control": str(control), "max_bytes": DISK_BYTES},
            }
        ],
    }
    s0, s1, s2, s3, s4 = c.SLOW
    steps: list[dict[str, Any]] = [
        _gen("store", *c.SLOW),  # cold: their chunks are stored (no delays yet)
        {"op": "control", "name": "slow", "values": SLOW},
        _itl("warmup", []),  # the first decoding run after start-up is not a baseline
        # baseline just before each slow run, in the same process: the decoding request
        # alone (interleaved, so a drift in the shared machine's load hits both alike)
        *[
            step
            for i in range(REPEATS)
            for step in (_itl(f"base{i}", []), _itl(f"slow{i}", [(s0, s1, s2)[i % 3]]))
        ],
        {"op": "control", "name": "slow_lookups", "values": {"lookup_delay_s": 2.0}},
        _gen("lookup_late", s3, no_disk_wait=True),
        {"op": "control", "name": "slow_gets", "values": {"get_delay_s": 2.0}},
        {"op": "abort_waiting", "name": "abort", "prompt": {"tokens": s4}},
        {
            "op": "evict_waiting",
            "name": "evict",
            "prompt": {"tokens": s0},
            "fill_chunks": 40,
            "shape": CHUNK_SHAPE,
            "max_bytes": DISK_BYTES,
        },
        {"op": "control", "name": "slow_puts", "values": {"put_delay_s": 5.0}},
        _gen("pending", c.DECODER + c.SLOW[0][:200], no_disk_wait=True),
        {"op": "shutdown", "name": "shutdown"},
    ]
    engine = {
        "model": str(vllm_models.main),
        "dtype": "float32",
        "block_size": c.BLOCK,
        "max_model_len": 1024,
        "max_num_batched_tokens": 256,
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "seed": 0,
        "kv_transfer_config": connector_config(storage, stats, lookup_deadline_ms=100),
    }
    spec = {
        "engine": engine,
        "steps": steps,
        "stats_dir": str(stats),
        "disk_dir": str(disk),
        "control_file": str(control),
    }
    return run_engine(work, "e9", spec, engine_env(multiprocessing=False))


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def test_a_slow_hit_waits_for_its_kv_without_stalling_decoding(e9: EngineRun) -> None:
    cold = {tuple(o["prompt"]): o for o in e9.outputs("store")}
    base = [e9.step(f"base{i}") for i in range(REPEATS)]
    slow = [e9.step(f"slow{i}") for i in range(REPEATS)]
    for rec in base + slow:
        assert rec["tokens"] == DECODE_TOKENS
    for rec in slow:
        (out,) = rec["outputs"]
        # the slow request waited for its KV (2 s) and is correct
        assert out["num_cached_tokens"] == 4 * c.CHUNK
        ref = cold[tuple(out["prompt"])]["tokens"]
        assert out["tokens"] == ref[: len(out["tokens"])] and len(out["tokens"]) == 4
        assert rec["ttft"][0] >= 2.0
    # a stalled engine step would show the 2 s get delay itself in some gap
    assert max(max(r["itl"]) for r in slow) < SLOW["get_delay_s"] / 2
    # each slow run against the baseline measured just before it, then the median
    pairs = list(zip(base, slow, strict=True))
    r99 = [_pct(s["itl"], 0.99) / _pct(b["itl"], 0.99) for b, s in pairs]
    r50 = [statistics.median(s["itl"]) / statistics.median(b["itl"]) for b, s in pairs]
    assert statistics.median(r99) <= 1.5, r99
    assert statistics.median(r50) <= 1.1, r50
    w = e9.worker(f"slow{REPEATS - 1}")
    assert w["async_loaded_chunks"] >= REPEATS * 4 and w["sync_loaded_chunks"] == 0


def test_a_lookup_past_its_deadline_is_a_counted_miss(e9: EngineRun) -> None:
    out = e9.outputs("lookup_late")[0]
    assert out["num_cached_tokens"] == 0
    before = e9.scheduler("slow_lookups")["lookup_deadline_misses"]
    assert e9.scheduler("lookup_late")["lookup_deadline_misses"] == before + 1


def test_abort_while_waiting_for_kv_frees_the_blocks_and_stores_nothing(e9: EngineRun) -> None:
    rec = e9.step("abort")
    assert not rec["unfinished"]
    assert rec["free_blocks_after"] == rec["free_blocks_before"]
    assert e9.worker("abort")["gathered_chunks"] == e9.worker("slow_gets")["gathered_chunks"]
    assert e9.scheduler("abort")["active_requests"] == 0


def test_another_process_evicting_between_lookup_and_load_spares_pinned_chunks(
    e9: EngineRun,
) -> None:
    rec = e9.step("evict")
    assert rec["evicted"] > 0  # the other process did evict (the tier holds 32 chunks)
    (out,) = rec["outputs"]
    cold = {tuple(o["prompt"]): o for o in e9.outputs("store")}
    assert out["tokens"] == cold[tuple(out["prompt"])]["tokens"]
    # the lookup pinned the request's chunks in the shared index: every process's
    # eviction skipped them, and the load found them all
    assert out["num_cached_tokens"] == 4 * c.CHUNK
    s_before, s_after = e9.scheduler("abort"), e9.scheduler("evict")
    assert s_after["stale_hits"] == s_before["stale_hits"]
    assert s_after["load_failures"] == s_before["load_failures"]


def test_shutdown_drains_pending_stores_up_to_the_timeout(e9: EngineRun) -> None:
    w = e9.worker("shutdown")
    assert w["dropped_saves_at_close"] >= 1
    assert w["pending_saves"] == 0
    assert w["saved_chunks"] == e9.worker("pending")["saved_chunks"]
