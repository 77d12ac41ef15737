"""``lmcache-core bench rag`` without an engine: the workload, the tier sizing, the
storage configurations and the simulator's prediction (the engine runs are in
tests/vllm/test_bench_rag_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmcache_core import TieredHierarchy
from lmcache_core.cli.bench_rag import (
    RagWorkload,
    kv_bytes_per_token,
    predict,
    storage_config,
    tier_bytes,
)
from lmcache_core.cli.main import main
from lmcache_core.config import load_config
from lmcache_core.placement import SimConfig, simulate
from lmcache_core.placement.simulator import working_set_bytes
from lmcache_core.testing import make_key, run_async

COST = {"tokens_per_s": 4000.0, "attn_tokens": 8192.0}


def test_workload_prompts_share_exactly_the_chunks_their_groups_share() -> None:
    w = RagWorkload(n_requests=40, n_docs=5, seed=3, chunk_tokens=16, vocab=512)
    assert w.params() == {
        "n_requests": 40,
        "n_docs": 5,
        "alpha": 0.8,
        "seed": 3,
        "chunk_tokens": 16,
        "vocab": 512,
    }
    again = RagWorkload(**w.params())
    assert [r.groups for r in again.requests] == [r.groups for r in w.requests]
    for i, r in enumerate(w.requests):
        toks = w.tokens(i)
        assert len(toks) == 16 * len(r.groups) and all(4 <= t < 512 for t in toks)
    a, b = next(
        (i, j)
        for i in range(40)
        for j in range(i + 1, 40)
        if w.requests[i].meta["doc"] == w.requests[j].meta["doc"]
    )
    shared = len(w.requests[a].groups) - 1  # instruction + document; the question differs
    assert w.tokens(a)[: 16 * shared] == w.tokens(b)[: 16 * shared]
    assert w.tokens(a)[16 * shared :] != w.tokens(b)[16 * shared :]
    # a redrawn question changes only the last chunk
    assert w.tokens(a, 1)[: 16 * shared] == w.tokens(a)[: 16 * shared]
    assert w.tokens(a, 1)[16 * shared :] != w.tokens(a)[16 * shared :]


def test_working_set_and_prediction_are_the_simulators_on_the_same_requests() -> None:
    w = RagWorkload(n_requests=120, n_docs=20, chunk_tokens=64)
    cb = 64 * 1024
    assert w.working_set_chunks() * cb == working_set_bytes(w.requests, cb // 64)
    n = w.working_set_chunks() // 4
    for policy in ("lru", "cost"):
        from lmcache_core.placement import PrefillCost

        cfg = SimConfig(n * cb, cb // 64, cost=PrefillCost(**COST))
        assert predict(w, policy, n, cb, COST) == simulate(w.requests, policy, cfg).tokens_saved
    assert predict(w, "cost", n, cb, COST) > predict(w, "lru", n, cb, COST)


def test_tier_bytes_hold_exactly_that_many_chunks_and_the_configs_load() -> None:
    cb = 64 * 1024
    for policy in ("lru", "cost"):
        cfg = storage_config(64, tier_bytes(5, cb), policy, COST, cb)
        loaded = load_config(cfg)
        assert (loaded.placement is None or loaded.placement.policy == "lru") == (policy == "lru")

        async def body(loaded: object = loaded) -> int:
            async with TieredHierarchy(loaded) as h:
                keys = [make_key(f"t{i}") for i in range(7)]
                await h.lookup_prefix(keys)
                for k in keys:
                    await h.put(k, torch.zeros(cb, dtype=torch.uint8))
                return sum([await h.tier("cpu").backend.contains(k) for k in keys])

        assert run_async(body()) == 5


def test_kv_bytes_per_token_of_a_llama_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 8,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "hidden_size": 512,
                "vocab_size": 4096,
            }
        )
    )
    assert kv_bytes_per_token(str(tmp_path)) == 2 * 8 * 4 * 64 * 4


def test_predict_only_prints_each_policys_prediction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    test_kv_bytes_per_token_of_a_llama_config(tmp_path)
    argv = ["bench", "rag", "--predict-only", "--model", str(tmp_path), "--json"]
    assert main([*argv, "--requests", "60", "--docs", "10", "--capacities", "0.25,0.5"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["capacity_fraction"] for r in doc["rows"]] == [0.25, 0.5]
    ws = doc["working_set_chunks"]
    assert [r["chunks"] for r in doc["rows"]] == [round(ws / 4), round(ws / 2)]
    for r in doc["rows"]:
        assert set(r["predicted_tokens_saved"]) == {"lru", "cost"}
    assert main(["bench", "rag", "--predict-only", "--policies", "lfu"]) == 2
