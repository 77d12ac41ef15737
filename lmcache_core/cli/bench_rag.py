"""``lmcache-core bench rag``: what a RAG prompt token costs with and without the cache,
and how much prefill each placement policy saves on the real engine.

The workload (:class:`RagWorkload`) is the simulator's RAG family at token level: a
shared instruction, one document drawn Zipf(``alpha``) from a pool, and a unique
question, each a whole number of chunks (:func:`~lmcache_core.placement.traces.rag_trace`
with its shapes: a 2-chunk instruction, documents of 2-8 chunks, a 1-chunk question).
Every chunk's tokens are derived from its group id, so the engine's prompts and the
simulator's trace are the same requests.

Engine runs (vLLM CPU, the demo's 8-layer float32 model, each in a child process of its
own, see :mod:`.bench_rag_engine`), all on the same prompts in the same order, one at a
time, vLLM's own prefix cache off:

1. without the connector: the reference outputs and timings; prompts whose greedy
   continuation has a top-1 margin at most ``--margin`` get a new question until it is
   larger (then no comparison can flip on float rounding);
2. with the connector and a ``cpu`` tier that holds the whole working set;
3. per ``--capacities`` fraction of the working set (the bytes of the chunks requested at
   least twice, as ``simulate`` defines it), once per ``--policies`` policy (``lru``:
   no ``placement`` section, the tier's own order; ``cost``: ``placement: {policy:
   cost}``).

Measured per run, from the engine's own counts: prompt tokens, tokens vLLM did not
compute (``num_cached_tokens``; the connector's own ``hit_tokens`` beside it), mean time
to first token, and engine seconds to first token per 1k prompt tokens. Beside each
policy's tokens saved: the simulator's prediction for the same trace and capacity
(``PrefillCost`` fitted to run 1's timings, the same model the cost policy is given).
The bar (issue 16): cost's measured gain over lru is at least half the predicted gain.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..placement.traces import Request, rag_trace
from .bench_rag_report import report

__all__ = ["RagWorkload", "add_rag_arguments", "run"]

#: Minimum top-1 minus top-2 log-probability along every compared greedy continuation.
MARGIN = 1e-2


@dataclass
class RagWorkload:
    """The RAG requests, as chunk groups (for the simulator) and token ids (for vLLM)."""

    n_requests: int = 200
    n_docs: int = 40
    alpha: float = 0.8
    seed: int = 0
    chunk_tokens: int = 32
    vocab: int = 4096
    requests: list[Request] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n_requests < 1 or self.n_docs < 1 or self.chunk_tokens < 1:
            raise ValueError("requests, docs and chunk tokens must be >= 1")
        self.requests = rag_trace(
            n_requests=self.n_requests,
            seed=self.seed,
            n_docs=self.n_docs,
            alpha=self.alpha,
            chunk_tokens=self.chunk_tokens,
        )

    def params(self) -> dict[str, Any]:
        """The constructor's arguments (what a child process rebuilds the workload from)."""
        return {k: v for k, v in asdict(self).items() if k != "requests"}

    def tokens(self, i: int, attempt: int = 0) -> list[int]:
        """Request ``i``'s prompt: each chunk's tokens drawn from its group id; the last
        chunk (the question) also from ``attempt`` (a new question, same structure)."""
        groups = self.requests[i].groups
        out: list[int] = []
        for j, g in enumerate(groups):
            seed = f"{g}/{attempt}" if j == len(groups) - 1 and attempt else str(g)
            rng = random.Random(seed)
            out += [rng.randrange(4, self.vocab) for _ in range(self.chunk_tokens)]
        return out

    def working_set_chunks(self) -> int:
        """Distinct chunks requested at least twice (no cache could serve the others)."""
        seen: dict[tuple[int, ...], int] = {}
        for r in self.requests:
            for j in range(len(r.groups)):
                key = tuple(r.groups[: j + 1])
                seen[key] = seen.get(key, 0) + 1
        return sum(1 for n in seen.values() if n >= 2)

    def distinct_chunks(self) -> int:
        return len({tuple(r.groups[: j + 1]) for r in self.requests for j in range(len(r.groups))})


def kv_bytes_per_token(model_dir: str) -> int:
    """KV bytes per token of a float32 Llama-style model (its ``config.json``)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * 4


def tier_bytes(chunks: int, chunk_bytes: int) -> int:
    """A ``cpu`` tier's ``max_bytes`` that holds exactly ``chunks`` chunks."""
    from ..backends.host_buffers import ENTRY_OVERHEAD

    return chunks * (chunk_bytes + ENTRY_OVERHEAD)


def storage_config(
    chunk_tokens: int, max_bytes: int, policy: str, cost: dict[str, float], chunk_bytes: int
) -> dict[str, Any]:
    """The connector's storage: one ``cpu`` tier; ``policy`` other than lru adds the
    ``placement`` section (lru: none, the tier's own order, today's default)."""
    cfg: dict[str, Any] = {
        "chunk_size": chunk_tokens,
        "tiers": [{"name": "cpu", "backend": "cpu", "options": {"max_bytes": max_bytes}}],
    }
    if policy != "lru":
        cfg["placement"] = {"policy": policy, "options": {"chunk_bytes": chunk_bytes, **cost}}
    return cfg


def predict(
    work: RagWorkload, policy: str, chunks: int, chunk_bytes: int, cost: dict[str, float]
) -> int:
    """Prefill tokens the simulator says ``policy`` saves on ``work`` with a tier of
    ``chunks`` chunks (the same requests, order and cost model as the engine runs)."""
    from ..placement import PrefillCost, SimConfig, simulate

    cfg = SimConfig(
        capacity_bytes=chunks * chunk_bytes,
        kv_bytes_per_token=chunk_bytes // work.chunk_tokens,
        cost=PrefillCost(**cost),
    )
    return simulate(work.requests, policy, cfg).tokens_saved


def fit_cost(results: list[dict[str, Any]]) -> tuple[dict[str, float], str]:
    """``PrefillCost`` parameters fitted to (prompt tokens, TTFT) of the run without the
    connector, and how they were obtained (the defaults when the fit fails)."""
    from ..placement import PrefillCost

    try:
        c = PrefillCost.fit([(r["prompt_tokens"], r["ttft_s"]) for r in results])
        return {"tokens_per_s": c.tokens_per_s, "attn_tokens": c.attn_tokens}, "fitted"
    except ValueError as exc:
        d = PrefillCost()
        return {"tokens_per_s": d.tokens_per_s, "attn_tokens": d.attn_tokens}, f"defaults ({exc})"


# ---------------------------------------------------------------------------- runs
@dataclass
class RunResult:
    """One engine run, summarised."""

    label: str
    results: list[dict[str, Any]]
    stats: list[dict[str, Any]]
    startup_s: float

    @property
    def prompt_tokens(self) -> int:
        return sum(r["prompt_tokens"] for r in self.results)

    @property
    def saved(self) -> int:
        """Tokens vLLM did not compute (its ``num_cached_tokens``)."""
        return sum(r["cached_tokens"] for r in self.results)

    @property
    def connector_hits(self) -> int | None:
        sched = [d for d in self.stats if d.get("role") == "scheduler"]
        return sum(int(d.get("hit_tokens", 0)) for d in sched) if sched else None

    @property
    def ttft_mean_s(self) -> float:
        return float(statistics.mean(float(r["ttft_s"]) for r in self.results))

    @property
    def seconds_per_1k(self) -> float:
        total = sum(float(r["ttft_s"]) for r in self.results)
        return 1000.0 * total / max(self.prompt_tokens, 1)

    def tier_stat(self, name: str) -> int | None:
        vals = [
            int(t.get(name, 0))
            for d in self.stats
            if d.get("role") == "worker"
            for t in d.get("tiers", [])
        ]
        return sum(vals) if vals else None

    def same_outputs(self, ref: RunResult) -> tuple[int, int]:
        pairs = list(zip(self.results, ref.results, strict=True))
        return sum(a["tokens"] == b["tokens"] for a, b in pairs), len(pairs)


def _run_engine(spec: dict[str, Any], tmp: Path, name: str) -> dict[str, Any]:
    spec_path, out_path, log_path = (
        tmp / f"{name}.spec.json",
        tmp / f"{name}.out.json",
        tmp / f"{name}.log",
    )
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lmcache_core.cli.bench_rag_engine",
                str(spec_path),
                str(out_path),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            rc = proc.wait()
        finally:  # interrupted (Ctrl-C, SIGTERM): the engine goes too
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if rc != 0 or not out_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"engine run {name!r} failed (exit {rc}); log tail:\n{tail}")
    out: dict[str, Any] = json.loads(out_path.read_text())
    return out


def _capacity_chunks(work: RagWorkload, fractions: list[float]) -> list[tuple[float, int]]:
    ws = work.working_set_chunks()
    return [(f, max(1, round(f * ws))) for f in fractions]


def run(args: argparse.Namespace) -> int:
    """Handler of ``lmcache-core bench rag``; returns the exit status."""
    from ..tables import format_table
    from .main import print_json, wants_json

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in ("lru", "arc", "s3fifo", "cost"):
            print(f"bench rag: unknown policy {p!r} (lru, arc, s3fifo, cost)", file=sys.stderr)
            return 2
    work = RagWorkload(args.requests, args.docs, args.alpha, args.seed, args.chunk_tokens)
    caps = _capacity_chunks(work, args.capacities)
    model = args.model
    if model is None:
        from ..integrations.vllm.local_model import DEMO_SPEC, make_local_model

        model = str(make_local_model(Path.cwd() / ".models" / "demo-llama", DEMO_SPEC))
    work.vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    chunk_bytes = kv_bytes_per_token(model) * work.chunk_tokens
    ws = work.working_set_chunks()
    head = (
        f"RAG workload: {work.n_requests} requests, {work.n_docs} documents (Zipf alpha "
        f"{work.alpha}, seed {work.seed}), chunk {work.chunk_tokens} tokens "
        f"({chunk_bytes / 2**20:.2f} MiB of KV), working set {ws} chunks "
        f"({work.distinct_chunks()} distinct)"
    )
    if args.predict_only:
        cost = {"tokens_per_s": args.tokens_per_s, "attn_tokens": args.attn_tokens}
        rows: list[dict[str, Any]] = []
        for frac, n in caps:
            guess = {p: predict(work, p, n, chunk_bytes, cost) for p in policies}
            rows.append({"capacity_fraction": frac, "chunks": n, "predicted_tokens_saved": guess})
        if wants_json(args):
            print_json({"workload": work.params(), "working_set_chunks": ws, "rows": rows})
        else:
            print(head)
            print(
                format_table(
                    [
                        [
                            f"{100 * r['capacity_fraction']:g}%",
                            r["chunks"],
                            *r["predicted_tokens_saved"].values(),
                        ]
                        for r in rows
                    ],
                    ["tier size", "chunks", *(f"{p} predicted" for p in policies)],
                )
            )
        return 0

    if threading.current_thread() is not threading.main_thread():
        return _run_engines(args, work, caps, policies, model, chunk_bytes, head)
    # a SIGTERM (e.g. from timeout) unwinds, so that the running engine is ended too
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _run_engines(args, work, caps, policies, model, chunk_bytes, head)
    finally:
        signal.signal(signal.SIGTERM, before)


def _run_engines(
    args: argparse.Namespace,
    work: RagWorkload,
    caps: list[tuple[float, int]],
    policies: list[str],
    model: str,
    chunk_bytes: int,
    head: str,
) -> int:
    from .main import wants_json

    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="lmcache-bench-rag-"))
    tmp.mkdir(parents=True, exist_ok=True)
    base_spec: dict[str, Any] = {
        "model": model,
        "workload": work.params(),
        "block_size": args.block_size,
        "max_tokens": args.max_tokens,
        "margin": args.margin,
        "max_attempts": 8,
    }
    quiet = wants_json(args)

    def log(text: str) -> None:
        if not quiet:
            print(text, flush=True)

    log(head)
    log("run 1: without the connector (reference, margin selection) ...")
    raw = _run_engine({**base_spec, "storage": None, "reselect": True}, tmp, "none")
    ref = RunResult("without connector", raw["results"], [], raw["startup_s"])
    attempts = raw["attempts"]
    cost, how = fit_cost(ref.results)
    if not args.calibrate:
        cost, how = {"tokens_per_s": args.tokens_per_s, "attn_tokens": args.attn_tokens}, "given"
    runs: dict[str, RunResult] = {}

    def engine(name: str, chunks: int, policy: str) -> RunResult:
        stats_dir = tmp / f"stats-{name}"
        spec = {
            **base_spec,
            "attempts": attempts,
            "storage": storage_config(
                work.chunk_tokens, tier_bytes(chunks, chunk_bytes), policy, cost, chunk_bytes
            ),
            "stats_dir": str(stats_dir),
        }
        out = _run_engine(spec, tmp, name)
        return RunResult(name, out["results"], out["stats"], out["startup_s"])

    if not args.skip_full:
        log("run 2: with the connector, a cpu tier holding every chunk ...")
        runs["full"] = engine("full", work.distinct_chunks() + 8, "lru")
    pred: dict[tuple[float, str], int] = {}
    for frac, n in caps:
        for p in policies:
            log(f"run: cpu tier {100 * frac:g}% of the working set ({n} chunks), policy {p} ...")
            runs[f"{frac}:{p}"] = engine(f"cap{frac}-{p}", n, p)
            pred[(frac, p)] = predict(work, p, n, chunk_bytes, cost)

    reselected = sum(1 for a in attempts if a)
    return report(
        args, work, ref, runs, caps, policies, pred, (cost, how, reselected), head, chunk_bytes
    )


def add_rag_arguments(ap: Any) -> None:
    """The arguments of ``lmcache-core bench rag``."""
    from .main import add_output_flags
    from .simulate import positive_floats

    ap.add_argument("--requests", type=int, default=200, help="requests (default 200)")
    ap.add_argument("--docs", type=int, default=40, help="documents in the pool (default 40)")
    ap.add_argument("--alpha", type=float, default=0.8, help="Zipf exponent (default 0.8)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--chunk-tokens", type=int, default=32, help="tokens per chunk (default 32)")
    ap.add_argument("--block-size", type=int, default=32, help="vLLM block size (default 32)")
    ap.add_argument(
        "--capacities",
        type=positive_floats,
        default=[0.1, 0.25, 0.5],
        help="cpu tier sizes as fractions of the working set (default 0.1,0.25,0.5)",
    )
    ap.add_argument("--policies", default="lru,cost", help="placement policies (default lru,cost)")
    ap.add_argument(
        "--max-tokens", type=int, default=4, help="greedy tokens per request (default 4)"
    )
    ap.add_argument(
        "--margin",
        type=float,
        default=MARGIN,
        help=f"top-1 margin for compared outputs (default {MARGIN})",
    )
    ap.add_argument(
        "--model",
        metavar="PATH",
        help="model folder (default: the demo's, made in .models/demo-llama)",
    )
    ap.add_argument(
        "--workdir", metavar="DIR", help="keep the runs' files here (default: a temporary folder)"
    )
    ap.add_argument(
        "--skip-full", action="store_true", help="no run with a tier holding every chunk"
    )
    ap.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="use --tokens-per-s/--attn-tokens instead of fitting them to the first run's timings",
    )
    ap.add_argument(
        "--tokens-per-s", type=float, default=8000.0, help="cost model without calibration"
    )
    ap.add_argument(
        "--attn-tokens", type=float, default=16384.0, help="cost model without calibration"
    )
    ap.add_argument(
        "--price-per-hour", type=float, help="also report currency per 1k prompt tokens"
    )
    ap.add_argument(
        "--predict-only", action="store_true", help="only the simulator's predictions (no engine)"
    )
    add_output_flags(ap)
