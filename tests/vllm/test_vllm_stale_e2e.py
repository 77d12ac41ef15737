"""A stale view of the workers' memory tier never fails a request (real engines).

A memory tier of 8 chunks, 50 prompts over 10 prompts of 2 chunks (a fixed revisiting
order, 3 at a time, vLLM's own prefix cache off): the workers' stores complete in the
background and evict chunks the scheduler may just have promised. Once with vLLM's
default ``kv_load_failure_policy`` (``fail``: the connector offers only chunks pinned
until they are loaded) and once with ``recompute`` (a promised chunk found evicted is
recomputed and counted as a stale hit). Stores into the memory tier take 50 ms in both
runs (``put_delay_s``) and the engine idles 250 ms between groups, so the last stores of
a group complete -- and evict -- after the last report the scheduler saw before the next
group's lookups: the race a busy server runs into, made frequent.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import vllm_cases as c
from conftest import EngineRun, Models, connector_config, engine_env, requires_vllm, run_engine

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

N_REQUESTS, GROUP = 50, 3
PUT_DELAY_S = 0.05
PAUSE_S = 0.25


def _order() -> list[int]:
    rng = random.Random(5)
    return [rng.randrange(len(c.STALE)) for _ in range(N_REQUESTS)]


def _stale_run(model: Path, work: Path, policy: str | None) -> EngineRun:
    name = f"stale-{policy or 'default'}"
    stats, control = work / f"stats-{name}", work / f"control-{name}.json"
    control.write_text(json.dumps({"put_delay_s": PUT_DELAY_S}))
    storage = {
        "chunk_size": c.CHUNK,
        "tiers": [
            {
                "name": "cpu",
                "backend_class": "kv_test_backends:FaultyCPUBackend",
                "options": {"max_bytes": 8 * 64 * 1024, "control": str(control)},
            }
        ],
    }
    order = _order()
    steps: list[dict[str, Any]] = []
    for start in range(0, N_REQUESTS, GROUP):
        group = [{"tokens": c.STALE[i]} for i in order[start : start + GROUP]]
        steps.append(
            {
                "op": "generate",
                "name": f"g{start}",
                "prompts": group,
                "max_tokens": 2,
                "pause_after_s": PAUSE_S,
            }
        )
    engine = {
        "model": str(model),
        "dtype": "float32",
        "block_size": c.BLOCK,
        "max_model_len": 1024,
        "max_num_batched_tokens": 256,
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "seed": 0,
        "kv_transfer_config": connector_config(storage, stats, policy=policy),
    }
    spec = {"engine": engine, "steps": steps, "stats_dir": str(stats)}
    return run_engine(work, name, spec, engine_env(multiprocessing=False))


@pytest.fixture(scope="module")
def stale_runs(
    vllm_models: Models, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, EngineRun]:
    work = tmp_path_factory.mktemp("vllm_stale")
    return {
        "fail": _stale_run(vllm_models.main, work, None),  # vLLM's default policy
        "recompute": _stale_run(vllm_models.main, work, "recompute"),
    }


def _all_outputs(run: EngineRun) -> list[dict[str, Any]]:
    return [o for name in run.results["steps"] for o in run.outputs(name)]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_no_request_fails(stale_runs: dict[str, EngineRun], policy: str) -> None:
    run = stale_runs[policy]
    outs = _all_outputs(run)
    assert len(outs) == N_REQUESTS
    assert all(o["finish_reason"] == "length" and len(o["tokens"]) == 2 for o in outs)
    last = list(run.results["steps"])[-1]
    s = run.scheduler(last)
    assert s["policy"] == ("fail" if policy == "fail" else "recompute")
    assert s["hit_requests"] > 0
    # Identical prompts give identical answers whether they hit, missed or recomputed.
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for o in outs:
        assert by_prompt.setdefault(tuple(o["prompt"]), o["tokens"]) == o["tokens"]


def test_fail_policy_promises_only_pinned_chunks(stale_runs: dict[str, EngineRun]) -> None:
    run = stale_runs["fail"]
    last = list(run.results["steps"])[-1]
    s, w = run.scheduler(last), run.worker(last)
    assert s["stale_hits"] == 0 and s["load_failures"] == 0 and w["failed_chunks"] == 0
    assert w["withdrawn"] > 0  # pins handed back so the tier keeps room for new chunks


def test_recompute_policy_counts_stale_hits(stale_runs: dict[str, EngineRun]) -> None:
    run = stale_runs["recompute"]
    last = list(run.results["steps"])[-1]
    s, w = run.scheduler(last), run.worker(last)
    assert s["stale_hits"] > 0
    assert w["failed_chunks"] >= s["stale_hits"]
    assert s["index_chunks"] <= 8  # the index follows the tier's evictions
