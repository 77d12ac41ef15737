"""Time to first token through LMCacheCoreConnector on vLLM (CPU), against baselines
measured in the same engine run.

For each of ``--prompts`` prompts of ``--tokens`` tokens (a multiple of the chunk size
plus one, so a hit leaves exactly one token to compute):

* ``cold``: the first run (full prefill; its chunks are stored);
* ``vllm prefix cache``: the same prompt again, served by vLLM's own prefix cache (the
  best case a connector hit can approach);
* ``connector``: again after ``reset_prefix_cache()``: loaded by the connector from its
  one tier (``--tier cpu`` or ``--tier disk``).

Prints medians and the ratios ``connector / vllm prefix cache`` and ``cold / connector``.
Run: ``.venv/bin/python benchmarks/bench_vllm.py`` (about two minutes; the engine runs in a
child process). ``--omp-passive`` sets ``OMP_WAIT_POLICY=PASSIVE`` for the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))


def _child(args: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(args.spec).read_text())
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        max_model_len=8192,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        kv_transfer_config=spec["ktc"],
    )
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(7)
    prompts = [
        [rng.randrange(4, spec["vocab"]) for _ in range(spec["tokens"])]
        for _ in range(spec["prompts"])
    ]
    llm.generate([TokensPrompt(prompt_token_ids=list(range(4, 300)))], sp, use_tqdm=False)

    def ttft(p: list[int]) -> tuple[float, int]:
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
        m = getattr(out, "metrics", None)
        return float(getattr(m, "first_token_latency", 0.0)), int(out.num_cached_tokens)

    rows: dict[str, list[tuple[float, int]]] = {"cold": [], "vllm": [], "connector": []}
    for p in prompts:
        rows["cold"].append(ttft(p))
        for _ in range(spec["repeats"]):
            rows["vllm"].append(ttft(p))
        for _ in range(spec["repeats"]):
            llm.reset_prefix_cache()
            rows["connector"].append(ttft(p))
    Path(args.out).write_text(json.dumps(rows))
    llm.llm_engine.engine_core.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2049)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument(
        "--tier",
        choices=("cpu", "disk"),
        default="cpu",
        help="the one tier the connector stores into",
    )
    ap.add_argument("--omp-passive", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return 0

    from demo import _model_spec

    from lmcache_core.integrations.vllm.local_model import make_local_model

    spec_m = _model_spec()
    model = make_local_model(ROOT / ".models" / "demo-llama", spec_m)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        tier: dict[str, Any] = (
            {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "2GiB"}}
            if args.tier == "cpu"
            else {"name": "disk", "backend": "disk", "options": {"path": f"{tmp}/kv"}}
        )
        storage: dict[str, Any] = {"chunk_size": args.chunk_size, "tiers": [tier]}
        stats_dir = Path(tmp, "stats")
        ktc = {
            "kv_connector": "LMCacheCoreConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config": storage, "stats_dir": str(stats_dir)},
        }
        spec = {
            "model": str(model),
            "ktc": ktc,
            "vocab": spec_m.vocab_size,
            "tokens": args.tokens,
            "prompts": args.prompts,
            "repeats": args.repeats,
        }
        spec_path, out_path = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec_path.write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        if args.omp_passive:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        t0 = time.monotonic()
        rc = subprocess.run(
            [sys.executable, __file__, "--child", "--spec", str(spec_path), "--out", str(out_path)],
            env=env,
            capture_output=True,
            text=True,
        )
        if rc.returncode != 0:
            print(rc.stdout[-3000:], rc.stderr[-3000:], file=sys.stderr)
            return 1
        rows = json.loads(out_path.read_text())
        from lmcache_core.integrations.vllm.stats_file import read_stats

        workers = [d for d in read_stats(str(stats_dir)) if d.get("role") == "worker"]

    med = {k: statistics.median(t for t, _ in v) for k, v in rows.items()}
    cached = {k: sorted({c for _, c in v}) for k, v in rows.items()}
    print(
        f"vLLM CPU, {spec_m.num_hidden_layers}-layer float32 model, {args.prompts} prompts x "
        f"{args.tokens} tokens, chunk {args.chunk_size}, OMP_WAIT_POLICY="
        f"{'PASSIVE' if args.omp_passive else 'default'} ({time.monotonic() - t0:.0f} s)"
    )
    for label, key in (
        ("cold prefill", "cold"),
        ("vllm prefix cache", "vllm"),
        (f"connector ({args.tier} tier)", "connector"),
    ):
        print(f"  {label:<22} TTFT median {med[key] * 1e3:8.1f} ms   cached tokens {cached[key]}")
    print(f"  connector / vllm prefix cache: {med['connector'] / med['vllm']:.2f}x")
    print(f"  cold / connector:              {med['cold'] / med['connector']:.1f}x")
    if workers:
        w = workers[0]
        print(
            f"  worker load breakdown (s): {w.get('load_breakdown_seconds')}, "
            f"loaded {w.get('loaded_bytes', 0) / 2**20:.0f} MiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
