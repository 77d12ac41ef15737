"""One engine run of ``lmcache-core bench rag``, in a child process of its own.

``python -m lmcache_core.cli.bench_rag_engine SPEC.json OUT.json`` starts vLLM (CPU,
float32, in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's own prefix cache
off so that every reuse goes through the connector), with or without the connector as
the spec says, then sends the prompts **one at a time, in order** (the order the
simulator replays), waiting after each until the connector's stores are in its tier, so
each request sees everything the earlier ones stored. Per request it records the prompt
tokens, vLLM's ``num_cached_tokens`` (the tokens it did not compute), the time to first
token, the greedy tokens and the top-1/top-2 log-probability margin along them.

With ``reselect`` (the run without the connector), requests whose margin is at most
``margin`` get a new question (``RagWorkload.tokens`` with the next attempt) until the
margin is larger (at most ``max_attempts``): outputs are then compared only on prompts
whose greedy continuation cannot flip on float rounding, as in the end-to-end tests. A
replaced request is timed again alone (no cache state: the order does not matter here).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["run_engine"]


def _wait_saves(timeout_s: float = 30.0) -> None:
    from ..integrations.vllm.in_process import wait_for_saves

    wait_for_saves(timeout_s, poll_s=0.002)


def _margin(completion: Any) -> float:
    """Smallest top-1 minus top-2 log-probability along a greedy completion."""
    worst = float("inf")
    for pos in completion.logprobs or []:
        vals = sorted((lp.logprob for lp in pos.values()), reverse=True)
        if len(vals) >= 2:
            worst = min(worst, vals[0] - vals[1])
    return worst


def _one(llm: Any, prompt: list[int], sp: Any) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    metrics = getattr(out, "metrics", None)
    ttft = float(getattr(metrics, "first_token_latency", 0.0) or 0.0) or wall
    comp = out.outputs[0]
    return {
        "prompt_tokens": len(prompt),
        "cached_tokens": int(out.num_cached_tokens or 0),
        "ttft_s": ttft,
        "wall_s": wall,
        "tokens": list(comp.token_ids),
        "margin": _margin(comp),
    }


def run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    """Serve ``spec``'s workload once (see the module docstring); the results."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from .bench_rag import RagWorkload

    work = RagWorkload(**spec["workload"])
    attempts: list[int] = list(spec.get("attempts") or [0] * len(work.requests))
    kw: dict[str, Any] = {}
    if spec.get("storage") is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "LMCacheCoreConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "config": spec["storage"],
                "stats_dir": spec["stats_dir"],
                "save_decode_chunks": False,
            },
        }
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        max_model_len=4096,
        block_size=spec["block_size"],
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=False,
        disable_log_stats=False,
        **kw,
    )
    startup = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True, logprobs=2)
    # warm-up: shorter than a chunk, so nothing is stored
    for n in (17, work.chunk_tokens - 1):
        warm = TokensPrompt(prompt_token_ids=list(range(4, 4 + n)))
        llm.generate([warm], sp, use_tqdm=False)
    results = []
    for i, _ in enumerate(work.requests):
        results.append(_one(llm, work.tokens(i, attempts[i]), sp))
        _wait_saves()
    if spec.get("reselect"):
        for i, res in enumerate(results):
            while res["margin"] <= spec["margin"] and attempts[i] + 1 < spec["max_attempts"]:
                attempts[i] += 1
                res = results[i] = _one(llm, work.tokens(i, attempts[i]), sp)
    stats: list[dict[str, Any]] = []
    if spec.get("stats_dir"):
        from ..integrations.vllm.stats_file import read_stats

        llm.llm_engine.engine_core.shutdown()  # writes the final statistics
        stats = read_stats(spec["stats_dir"])
    return {"startup_s": startup, "results": results, "attempts": attempts, "stats": stats}


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    for k, v in {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(k, v)
    out = run_engine(json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
