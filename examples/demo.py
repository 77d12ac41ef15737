"""`make demo`: vLLM (CPU) serving a RAG-like workload through LMCacheCoreConnector.

1. Creates a local random-weight Llama-style model in ``.models/`` if missing (nothing is
   downloaded).
2. Pass 1 starts a vLLM engine with the connector on a CPU + disk hierarchy and sends
   several long documents with several questions each: the first question of each
   document is a cold prefill, its chunks are stored (CPU tier, written through to disk).
3. Pass 2 starts a **fresh engine process** on the same disk tier and sends the same
   workload: the documents now come from the disk tier instead of being recomputed.
4. Prints time-to-first-token cold vs warm, hit tokens, bytes and load GB/s per tier,
   and checks that both passes produced the same tokens.
5. Runs a small ``lmcache-core bench rag`` (docs/placement.md): RAG prompts with and
   without the connector (prefill tokens computed, mean TTFT, seconds per 1k prompt
   tokens), then a cpu tier at a quarter of the working set under the LRU and the
   cost-aware placement policies, beside the simulator's prediction (``--no-rag``
   skips it; ``RAG_ARGS`` in the environment replaces its arguments).

With ``DEMO_REMOTE=s3`` (``DEMO_REMOTE=s3 make demo``) the demo also starts a local S3
API server (moto's server mode, from ``lmcache-backend-s3``), adds an ``s3`` tier on one
bucket, and runs pass 3: another "host" with its own empty CPU and disk tiers and the same
bucket, which loads the documents from the bucket.

Run: ``make demo`` (or ``.venv/bin/python examples/demo.py --help``). A few minutes here.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lmcache_core.sizes import format_bytes
from lmcache_core.tables import format_table

ROOT = Path(__file__).resolve().parent.parent

#: The storage configuration (lmcache-core schema); ``{demo}`` is the work directory.
DEFAULT_CONFIG: dict[str, Any] = {
    "chunk_size": 256,
    "tiers": [
        {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "2GiB"}},
        {
            "name": "disk",
            "backend": "disk",
            "options": {"path": "{demo}/kv", "max_bytes": "8GiB"},
            "write": {"policy": "through"},
        },
    ],
}

SYSTEM = (
    "answer the question using only the document below . "
    "if the document does not say , answer that it does not say ."
)


def _model_spec() -> Any:
    from lmcache_core.integrations.vllm.local_model import DEMO_SPEC

    return DEMO_SPEC


def _workload(n_docs: int, n_questions: int, doc_words: int, vocab: int) -> list[dict[str, Any]]:
    from lmcache_core.integrations.vllm.local_model import words_to_text

    rng = random.Random(1234)
    reqs = []
    for d in range(n_docs):
        doc = words_to_text(rng, doc_words, vocab)
        for q in range(n_questions):
            question = words_to_text(rng, 12, vocab)
            prompt = f"{SYSTEM} document : {doc} question : {question} answer :"
            reqs.append({"doc": d, "question": q, "prompt": prompt})
    return reqs


# ------------------------------------------------------------------------ engine pass
def run_pass(args: argparse.Namespace) -> None:
    """One engine process: serve the workload and write the results (child process)."""
    from vllm import LLM, SamplingParams

    work = Path(args.workdir)
    spec = json.loads((work / "pass.json").read_text())
    t0 = time.monotonic()
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        max_model_len=8192,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        kv_transfer_config=spec["kv_transfer_config"],
    )
    startup = time.monotonic() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(["warm up the engine ."], params, use_tqdm=False)
    results = []
    for req in spec["workload"]:
        t1 = time.monotonic()
        out = llm.generate([req["prompt"]], params, use_tqdm=False)[0]
        wall = time.monotonic() - t1
        metrics = getattr(out, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", 0.0) or wall
        results.append(
            {
                **{k: req[k] for k in ("doc", "question")},
                "ttft_s": ttft,
                "wall_s": wall,
                "prompt_tokens": len(out.prompt_token_ids or []),
                "cached_tokens": out.num_cached_tokens,
                "tokens": list(out.outputs[0].token_ids),
            }
        )
    (work / f"pass{args.run_pass}.json").write_text(
        json.dumps({"startup_s": startup, "results": results})
    )
    # Shut the engine down here, so the connector flushes its disk writes before exit.
    llm.llm_engine.engine_core.shutdown()


# ------------------------------------------------------------------------ driver
def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _stats(directory: Path) -> dict[str, Any]:
    from lmcache_core.integrations.vllm.stats_file import read_stats

    docs = read_stats(str(directory))
    sched = [d for d in docs if d.get("role") == "scheduler"]
    workers = [d for d in docs if d.get("role") == "worker"]
    by_tier: dict[str, int] = {}
    rate: dict[str, list[float]] = {}
    for w in workers:
        for tier, n in w.get("loaded_tokens_by_tier", {}).items():
            by_tier[tier] = by_tier.get(tier, 0) + int(n)
        for tier, r in w.get("load_rate_by_tier", {}).items():
            acc = rate.setdefault(tier, [0.0, 0.0])
            acc[0] += float(r.get("bytes", 0))
            acc[1] += float(r.get("seconds", 0))
    return {
        "hit_tokens": sum(int(d.get("hit_tokens", 0)) for d in sched),
        "by_tier": by_tier,
        "rate": rate,
        "loaded_bytes": sum(int(w.get("loaded_bytes", 0)) for w in workers),
        "load_seconds": sum(float(w.get("load_seconds", 0)) for w in workers),
        "saved_chunks": sum(int(w.get("saved_chunks", 0)) for w in workers),
        "saved_bytes": sum(int(w.get("saved_bytes", 0)) for w in workers),
        "failed_chunks": sum(int(w.get("failed_chunks", 0)) for w in workers),
        "scheduler_pids": sorted({int(d["pid"]) for d in sched}),
        "worker_pids": sorted({int(w["pid"]) for w in workers}),
    }


def _gbps(acc: list[float] | None) -> str:
    """``bytes / seconds`` of the loads from one tier (see the worker's load_rate_by_tier:
    before the forward pass, read + scatter; in the background, first read to done)."""
    if not acc or acc[1] <= 0:
        return "-"
    return f"{acc[0] / acc[1] / 1e9:.2f} ({format_bytes(acc[0])} in {acc[1] * 1e3:.0f} ms)"


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------ DEMO_REMOTE=s3
def _with_local_s3(storage: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """A local S3 server (stopped at exit), the storage with an s3 tier on its bucket, and
    the environment holding the credentials that the tier reads through ``$env``."""
    from lmcache_backend_s3.s3server import start_local_s3

    server = start_local_s3("demo-kv")
    atexit.register(server.stop)
    tier = {
        "name": "remote",
        "backend": f"s3://{server.bucket}/kv",
        "options": {
            "endpoint_url": server.endpoint_url,
            "region": server.region,
            "access_key_id": {"$env": "LMC_S3_ACCESS_KEY_ID"},
            "secret_access_key": {"$env": "LMC_S3_SECRET_ACCESS_KEY"},
        },
        "load_deadline_ms": 5000,
        "lookup_deadline_ms": 2000,
    }
    return {**storage, "tiers": [*storage["tiers"], tier]}, server.env()


def _other_host(storage: dict[str, Any], work: Path) -> dict[str, Any]:
    """The storage of pass 3: the same tiers, but a disk tier of its own (another host)."""
    tiers = []
    for t in storage["tiers"]:
        if t.get("backend") == "disk":
            t = {**t, "options": {**t.get("options", {}), "path": str(work / "kv-host2")}}
        tiers.append(t)
    return {**storage, "tiers": tiers}


def _remote_report(outputs: dict[int, dict[str, Any]]) -> str:
    f1 = _median([r["ttft_s"] for r in outputs[1]["results"] if r["question"] == 0])
    f3 = _median([r["ttft_s"] for r in outputs[3]["results"] if r["question"] == 0])
    same = sum(
        a["tokens"] == b["tokens"]
        for a, b in zip(outputs[1]["results"], outputs[3]["results"], strict=True)
    )
    n = len(outputs[3]["results"])
    return (
        "  pass 3 (another host: own cpu and disk tiers, same S3 bucket)\n"
        f"    TTFT, first question per document (median): {f3 * 1e3:.0f} ms "
        f"(cold {f1 * 1e3:.0f} ms: {f1 / f3:.1f}x faster)\n"
        f"    tokens loaded by tier: {outputs[3]['stats']['by_tier']}\n"
        f"    outputs identical to pass 1: {same}/{n} {'(ok)' if same == n else '(MISMATCH)'}\n"
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--workdir", default=str(ROOT / ".demo"), help="work directory (disk tier, stats)"
    )
    ap.add_argument("--model-dir", default=str(ROOT / ".models" / "demo-llama"))
    ap.add_argument("--config", help="storage config file (YAML/JSON) instead of the embedded one")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--doc-words", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--no-rag", action="store_true", help="skip the bench rag step")
    ap.add_argument("--run-pass", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_pass:
        run_pass(args)
        return 0

    from lmcache_core.integrations.vllm.local_model import make_local_model

    work = Path(args.workdir)
    spec = _model_spec()
    t0 = time.monotonic()
    model = make_local_model(args.model_dir, spec)
    print(f"model: {model} ({time.monotonic() - t0:.1f} s to create or check)")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    if args.config:
        from lmcache_core.integrations.vllm.settings import parse_settings

        storage = parse_settings({"config_file": args.config}).storage
    else:
        storage = json.loads(json.dumps(DEFAULT_CONFIG).replace("{demo}", str(work)))
    workload = _workload(args.docs, args.questions, args.doc_words, spec.vocab_size)
    outputs = {}
    passes: tuple[int, ...] = (1, 2)
    remote_env: dict[str, str] = {}
    if os.environ.get("DEMO_REMOTE", "") == "s3":
        (storage, remote_env), passes = _with_local_s3(storage), (1, 2, 3)
    for p in passes:
        stats_dir = work / f"stats-pass{p}"
        ktc = {
            "kv_connector": "LMCacheCoreConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "config": _other_host(storage, work) if p == 3 else storage,
                "stats_dir": str(stats_dir),
            },
        }
        (work / "pass.json").write_text(
            json.dumps({"model": str(model), "kv_transfer_config": ktc, "workload": workload})
        )
        label = "cold engine" if p == 1 else "fresh engine process, same disk tier"
        label = "another host: own cpu and disk tiers, same S3 bucket" if p == 3 else label
        print(f"pass {p} ({label}): starting vLLM ...", flush=True)
        t1 = time.monotonic()
        with open(work / f"pass{p}.log", "w") as log:
            rc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--run-pass",
                    str(p),
                    "--workdir",
                    str(work),
                    "--max-tokens",
                    str(args.max_tokens),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**_child_env(), **remote_env},
            ).returncode
        if rc != 0 or not (work / f"pass{p}.json").exists():
            tail = (work / f"pass{p}.log").read_text(errors="replace")[-4000:]
            print(f"pass {p} failed (exit {rc}); log tail:\n{tail}", file=sys.stderr)
            return 1
        outputs[p] = json.loads((work / f"pass{p}.json").read_text())
        outputs[p]["stats"] = _stats(stats_dir)
        print(
            f"pass {p}: done in {time.monotonic() - t1:.0f} s "
            f"(engine start {outputs[p]['startup_s']:.0f} s)",
            flush=True,
        )

    print(_report(outputs, args, spec, int(storage.get("chunk_size", 256))))
    if 3 in outputs:
        print(_remote_report(outputs))
    same = all(
        a["tokens"] == b["tokens"]
        for p in passes[1:]
        for a, b in zip(outputs[1]["results"], outputs[p]["results"], strict=True)
    )
    rag = 0 if args.no_rag else _bench_rag(model, work)
    return 0 if same and rag == 0 else 1


#: The demo's small ``bench rag`` (the full one: ``lmcache-core bench rag``).
RAG_ARGS = "--requests 100 --docs 20 --capacities 0.25"


def _bench_rag(model: Path, work: Path) -> int:
    """``lmcache-core bench rag`` on the demo's model, small (4 engine runs)."""
    import shlex

    from lmcache_core.cli.main import main as cli

    extra = shlex.split(os.environ.get("RAG_ARGS", RAG_ARGS))
    print(f"\nlmcache-core bench rag {' '.join(extra)} (docs/placement.md) ...", flush=True)
    return cli(
        ["bench", "rag", "--table", "--model", str(model), "--workdir", str(work / "rag"), *extra]
    )


def _report(
    outputs: dict[int, dict[str, Any]], args: argparse.Namespace, spec: Any, chunk_size: int
) -> str:
    rows: list[tuple[str, str, str]] = [("", "pass 1 (cold)", "pass 2 (fresh process)")]

    def first(p: int) -> list[float]:
        return [r["ttft_s"] for r in outputs[p]["results"] if r["question"] == 0]

    def rest(p: int) -> list[float]:
        return [r["ttft_s"] for r in outputs[p]["results"] if r["question"] > 0]

    f1, f2 = _median(first(1)), _median(first(2))
    rows.append(
        (
            "TTFT, first question per document (median)",
            f"{f1 * 1e3:.0f} ms",
            f"{f2 * 1e3:.0f} ms  ({f1 / f2:.1f}x faster)",
        )
    )
    rows.append(
        (
            "TTFT, follow-up questions (median)",
            f"{_median(rest(1)) * 1e3:.0f} ms",
            f"{_median(rest(2)) * 1e3:.0f} ms",
        )
    )
    for label, key in (
        ("prompt tokens", "prompt_tokens"),
        ("tokens not recomputed", "cached_tokens"),
    ):
        rows.append(
            (
                label,
                f"{sum(r[key] for r in outputs[1]['results']):,}",
                f"{sum(r[key] for r in outputs[2]['results']):,}",
            )
        )
    s1, s2 = outputs[1]["stats"], outputs[2]["stats"]

    def local(p: int) -> int:
        return int(
            sum(r["cached_tokens"] for r in outputs[p]["results"])
            - outputs[p]["stats"]["hit_tokens"]
        )

    rows.append(("  from vLLM's own prefix cache", f"{local(1):,}", f"{local(2):,}"))
    tiers = sorted(set(s1["by_tier"]) | set(s2["by_tier"]) | {"cpu", "disk"})
    for t in tiers:
        rows.append(
            (
                f"  from the connector, tier {t!r}",
                f"{s1['by_tier'].get(t, 0):,}",
                f"{s2['by_tier'].get(t, 0):,}",
            )
        )
    rows.append(
        (
            "bytes loaded by the connector",
            format_bytes(s1["loaded_bytes"]),
            format_bytes(s2["loaded_bytes"]),
        )
    )
    rows.append(
        (
            "time spent loading before forward passes",
            f"{s1['load_seconds'] * 1e3:.0f} ms",
            f"{s2['load_seconds'] * 1e3:.0f} ms",
        )
    )
    for t in tiers:
        rows.append((f"load GB/s, tier {t!r}", _gbps(s1["rate"].get(t)), _gbps(s2["rate"].get(t))))
    rows.append(
        (
            "chunks stored (bytes)",
            f"{s1['saved_chunks']} ({format_bytes(s1['saved_bytes'])})",
            f"{s2['saved_chunks']} ({format_bytes(s2['saved_bytes'])})",
        )
    )
    rows.append(("chunks that failed to load", str(s1["failed_chunks"]), str(s2["failed_chunks"])))
    rows.append(
        (
            "connector pids (scheduler / workers)",
            f"{s1['scheduler_pids']} / {s1['worker_pids']}",
            f"{s2['scheduler_pids']} / {s2['worker_pids']}",
        )
    )
    same = sum(
        a["tokens"] == b["tokens"]
        for a, b in zip(outputs[1]["results"], outputs[2]["results"], strict=True)
    )
    n = len(outputs[1]["results"])
    head = (
        f"\nlmcache-core + vLLM: {args.docs} documents x {args.questions} questions "
        f"(~{args.doc_words} words each), {spec.num_hidden_layers}-layer float32 model, "
        f"chunk {chunk_size} tokens\n"
    )
    tail = (
        f"\n  outputs identical across passes: {same}/{n} {'(ok)' if same == n else '(MISMATCH)'}\n"
    )
    table = format_table(rows[1:], rows[0])
    return head + "\n".join("  " + line for line in table.splitlines()) + tail


if __name__ == "__main__":
    sys.exit(main())
