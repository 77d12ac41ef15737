"""``lmcache-core bench rag`` end to end on real vLLM (CPU build): two engine processes.

Tiny arguments: 24 RAG requests over 3 documents on the 2-layer test model; the run
without the connector (margin selection, the reference outputs) and one with a cpu tier
at half the working set under the cost-aware placement policy. The engine's own count of
tokens it did not compute equals the connector's, the outputs are the reference's, and
the policy, which sees each request's chain through ``observe_prefix``, saves what the
simulator predicts for the same requests within a few chunks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Models, requires_vllm

from lmcache_core.cli.main import main

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]


def test_bench_rag_tiny(
    vllm_models: Models, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "rag", "--model", str(vllm_models.main), "--workdir", str(tmp_path)]
    argv += ["--requests", "24", "--docs", "3", "--capacities", "0.5", "--policies", "cost"]
    assert main([*argv, "--skip-full", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (ref,) = doc["with_without"].values()
    assert ref["prefill_tokens_saved"] == 0 and ref["connector_hit_tokens"] is None
    assert ref["outputs_identical"] == "24/24"
    assert doc["min_margin"] > 1e-2
    (row,) = doc["capacities"]
    assert row["policy"] == "cost" and row["outputs_identical"] == "24/24"
    assert row["prompt_tokens"] == ref["prompt_tokens"]
    saved = row["prefill_tokens_saved"]
    assert saved > 0 and saved == row["connector_hit_tokens"]
    assert row["prefill_tokens_computed"] == row["prompt_tokens"] - saved
    assert abs(saved - row["predicted_tokens_saved"]) <= 2 * 32, row
