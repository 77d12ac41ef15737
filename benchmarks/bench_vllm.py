"""LMCacheCoreConnector on vLLM (CPU): what a hit costs, what a miss costs, and how fast
the worker loads from disk -- each against a baseline measured in the same run.

Scenarios (``--scenario``, default all), on the demo's model (8-layer float32 Llama):

* ``hit``: time to first token of a prompt whose KV is in the connector's CPU tier,
  against vLLM's own prefix-cache hit on the same prompt: per pair, a vLLM hit, a second
  vLLM hit (the A/A twin) and a connector hit (after ``reset_prefix_cache()``) in random
  order; the median of the per-pair ratios with a 95% bootstrap interval, beside the
  same for vLLM's hit against itself. Target: <= 1.2x.
* ``disk``: one request loading N chunks from a disk-only tier on an idle in-process
  engine, page cache dropped for the tier's files (``posix_fadvise``): bytes / (first
  read issued -> ``get_finished`` reported), from the worker's statistics; against the
  disk backend's own ``batched_get_into`` of the same N chunks, same batch and
  concurrency, page cache dropped, interleaved. Target: >= 0.7x.
* ``miss``: the connector's cost when nothing hits (CPU + disk tiers, saves included):
  three engine processes alive together -- two without the connector (the baseline and
  its A/A twin) and one with it -- each measured once per round in random order: TTFT
  of a unique prompt and the wall time of a 20-request batch of unique prompts. A
  measurement ends only once the engine's saves are in every tier (so no store runs
  into another engine's measurement); the wall time to the outputs is judged, the time
  until the saves are done is printed beside it. Per-round ratios: connector / baseline
  (the geometric mean of the two engines without it) and twin / first engine (A/A),
  medians with 95% bootstrap intervals. Target: <= 1.05x.

Verdicts: ``met`` when the median's 95% interval lies at or under the target, ``not
met`` when it lies above, ``within noise`` otherwise, and also when the A/A median's
interval excludes 1 (the set-up itself is then biased: two identical engine processes
measured 0.85x of each other in one run).

Run: ``.venv/bin/python benchmarks/bench_vllm.py`` (about 12 minutes here; engines run in
child processes). ``--scenario hit --tier disk`` measures a disk-tier hit instead.
"""

from __future__ import annotations

import argparse
import asyncio
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


# ---------------------------------------------------------------------------- children
def _llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {}
    if spec.get("ktc"):
        kw["kv_transfer_config"] = spec["ktc"]
    return LLM(
        model=spec["model"],
        dtype="float32",
        max_model_len=8192,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        enable_prefix_caching=spec.get("prefix_caching", True),
        **kw,
    )


def _prompts(spec: dict[str, Any], n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, spec["vocab"]) for _ in range(tokens)] for _ in range(n)]


def _ttft(llm: Any, p: list[int], max_tokens: int = 1) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
    m = getattr(out, "metrics", None)
    return float(getattr(m, "first_token_latency", 0.0)), int(out.num_cached_tokens)


def _child_hit(spec: dict[str, Any]) -> dict[str, Any]:
    llm = _llm(spec)
    _ttft(llm, list(range(4, 300)))
    rows: dict[str, list[Any]] = {"cold": [], "vllm": [], "connector": [], "vllm_aa": []}
    rng = random.Random(5)
    for p in _prompts(spec, spec["prompts"], spec["tokens"], 7):
        rows["cold"].append(_ttft(llm, p))
        # The cold run's chunks are stored in the background and reach the scheduler's
        # index with the next step's report: one unrecorded vLLM hit after they are in,
        # or a connector hit measured first would find only part of the prompt.
        time.sleep(1.0)
        _ttft(llm, p)
        for _ in range(spec["pairs"]):
            # The three measurements of a pair in random order: a connector hit follows
            # a reset of vLLM's prefix cache and leaves the prompt's blocks in it again.
            order = ["vllm", "vllm_aa", "connector"]
            rng.shuffle(order)
            for what in order:
                if what == "connector":
                    llm.reset_prefix_cache()
                rows[what].append(_ttft(llm, p))
    llm.llm_engine.engine_core.shutdown()
    return rows


def _drop_page_cache(root: str) -> int:
    """Evict the tier's files from the page cache (only them: the machine is shared)."""
    n = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def _child_disk(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from lmcache_backend_disk.backend import DiskBackend

    from lmcache_core import SyncBackend
    from lmcache_core.integrations.vllm.stats_file import read_stats
    from lmcache_core.keys import Namespace
    from lmcache_core.token_db import ChunkedTokenDatabase

    llm = _llm(spec)
    (prompt,) = _prompts(spec, 1, spec["tokens"], 11)
    _ttft(llm, prompt)  # cold: stores the chunks on disk
    time.sleep(1.0)

    def stats(role: str) -> dict[str, Any]:
        (doc,) = [d for d in read_stats(spec["stats_dir"]) if d.get("role") == role]
        return doc

    ns = Namespace.from_json(json.dumps(stats("scheduler")["namespace"]))
    db = ChunkedTokenDatabase(namespace=ns, dtype=ns.kv_dtype)
    keys = db.keys(prompt[: (len(prompt) // ns.chunk_size) * ns.chunk_size])
    backend = SyncBackend(DiskBackend({"path": spec["disk"]}, namespace=ns))
    backend.start()
    shape = backend.get(keys[0]).shape
    outs = [torch.empty(shape, dtype=torch.float32) for _ in keys]
    rows: dict[str, list[float]] = {"worker": [], "worker_reads": [], "backend": [], "single": []}
    for _ in range(spec["reps"]):
        llm.reset_prefix_cache()
        _drop_page_cache(spec["disk"])
        _, cached = _ttft(llm, prompt)
        assert cached >= len(keys) * ns.chunk_size - 1, cached
        nbytes, secs, reads = stats("worker")["async_load_throughput"][-1]
        rows["worker"].append(nbytes / secs)
        rows["worker_reads"].append(nbytes / reads)
        # the same chunks read by the backend: one batched call (its own concurrency) ...
        _drop_page_cache(spec["disk"])
        t0 = time.perf_counter()
        assert all(backend.batched_get_into(keys, outs))
        rows["backend"].append(sum(o.numel() * 4 for o in outs) / (time.perf_counter() - t0))
        # ... and one call per chunk, all in flight at once (as the worker issues them)
        _drop_page_cache(spec["disk"])

        async def each() -> list[bool]:
            inner = backend.backend
            return list(
                await asyncio.gather(
                    *(inner.get_into(k, o) for k, o in zip(keys, outs, strict=True))
                )
            )

        t0 = time.perf_counter()
        assert all(backend.io.run(each()))
        rows["single"].append(sum(o.numel() * 4 for o in outs) / (time.perf_counter() - t0))
    backend.close()
    llm.llm_engine.engine_core.shutdown()
    return {**rows, "chunks": len(keys), "chunk_bytes": outs[0].numel() * 4}


def _saves_pending() -> int:
    """Chunks this process's connector still has to store (gathered, not yet in the
    first tier, or queued or running for a tier below); 0 without a connector. The
    worker shares the process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return 0
    worker = getattr(get_kv_transfer_group(), "_worker", None)
    if worker is None or worker.saves is None or worker.storage is None:
        return 0
    return int(worker.saves.pending) + int(worker.storage.stats()["pending_stores"])


def _wait_saves(timeout: float = 60.0) -> float:
    """Wait until every save has reached every tier; seconds waited."""
    t0 = time.perf_counter()
    while _saves_pending() and time.perf_counter() - t0 < timeout:
        time.sleep(0.005)
    return time.perf_counter() - t0


def _child_serve(spec: dict[str, Any], out_prefix: str) -> None:
    """An engine that runs the miss measurements the parent asks for, one per line of
    stdin (``ttft SEED`` or ``batch SEED``), answering ``DONE n`` on stdout once the
    result is in ``<out_prefix>.<n>.json``: ``[seconds to the outputs, seconds until
    the saves were in every tier]``. The engine returns only once its saves are done,
    so no background store runs into another engine's measurement."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _llm(spec)
    _ttft(llm, list(range(4, 300)))
    _wait_saves()
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    print("READY", flush=True)
    for n, line in enumerate(sys.stdin):
        what, seed = line.split()
        if what == "ttft":
            (p,) = _prompts(spec, 1, spec["tokens"], int(seed))
            t0 = time.perf_counter()
            ttft = _ttft(llm, p)[0]
            done = time.perf_counter() - t0
            res: Any = [ttft, done + _wait_saves()]
        elif what == "batch":
            batch = [
                TokensPrompt(prompt_token_ids=p)
                for p in _prompts(spec, 20, spec["batch_tokens"], int(seed))
            ]
            t0 = time.perf_counter()
            outs = llm.generate(batch, sp, use_tqdm=False)
            done = time.perf_counter() - t0
            res = [done, done + _wait_saves()]
            assert all(o.num_cached_tokens == 0 for o in outs)
        else:
            break
        Path(f"{out_prefix}.{n}.json").write_text(json.dumps(res))
        print(f"DONE {n}", flush=True)
    llm.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------------------- parent
def _env(in_process: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    return env


def _run_child(kind: str, spec: dict[str, Any], tmp: Path, in_process: bool = False) -> Any:
    spec_path, out_path = tmp / f"{kind}.spec.json", tmp / f"{kind}.out.json"
    spec_path.write_text(json.dumps(spec))
    rc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--spec",
            str(spec_path),
            "--out",
            str(out_path),
        ],
        env=_env(in_process),
        capture_output=True,
        text=True,
    )
    if rc.returncode != 0:
        print(rc.stdout[-3000:], rc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{kind} child failed")
    return json.loads(out_path.read_text())


def _ktc(storage: dict[str, Any], stats: Path, **options: Any) -> dict[str, Any]:
    return {
        "kv_connector": "LMCacheCoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config": storage, "stats_dir": str(stats), **options},
    }


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}x" if xs else "-"


def _median_ci(xs: list[float], seed: int = 0, n: int = 4000) -> tuple[float, float, float]:
    """Median of ``xs`` and a 95% bootstrap interval of it (the median's uncertainty)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return statistics.median(xs), meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def _verdict(ratio: list[float], aa: list[float], target: float) -> str:
    """``met`` / ``not met`` when the median's 95% interval lies on one side of the
    target, else ``within noise``; also ``within noise`` when the A/A median's interval
    (the same measurement against itself) excludes 1: the set-up is then biased by more
    than its interval shows (e.g. two identical engine processes running at different
    speeds), and no verdict at the target's scale holds."""
    med, lo, hi = _median_ci(ratio)
    amed, alo, ahi = _median_ci(aa, seed=1)
    word = "met" if hi <= target else "not met" if lo > target else "within noise"
    if not alo <= 1.0 <= ahi:
        word = "within noise (the A/A interval excludes 1)"
    return (
        f"median {med:.3f}x, 95% CI {lo:.3f}-{hi:.3f}x (per-pair {_spread(ratio)}); "
        f"A/A median {amed:.3f}x, 95% CI {alo:.3f}-{ahi:.3f}x (per-pair {_spread(aa)}); "
        f"target <= {target}x: {word}"
    )


def _print_load_breakdown(stats_dir: Path, hits: int) -> None:
    """Where the worker's synchronous loads spent their time, per connector hit (from its
    statistics file; the cold runs load nothing, the unrecorded warm-ups nothing either)."""
    from lmcache_core.integrations.vllm.stats_file import read_stats

    docs = [d for d in read_stats(str(stats_dir)) if d.get("role") == "worker"]
    if not docs or not hits:
        return
    w = docs[-1]
    br = w.get("load_breakdown_seconds", {})
    per = {k: 1e3 * float(v) / hits for k, v in br.items() if k != "async_scatter"}
    print(
        f"  worker load per connector hit (mean of {hits}): total "
        f"{1e3 * float(w.get('load_seconds', 0.0)) / hits:.1f} ms = "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in per.items())
        + f" ({w.get('sync_loaded_chunks', 0)} chunks loaded in all)"
    )


def scenario_hit(args: argparse.Namespace, base: dict[str, Any], tmp: Path) -> None:
    tier: dict[str, Any] = (
        {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "2GiB"}}
        if args.tier == "cpu"
        else {"name": "disk", "backend": "disk", "options": {"path": str(tmp / "kv-hit")}}
    )
    storage = {"chunk_size": args.chunk_size, "tiers": [tier]}
    spec = {
        **base,
        "ktc": _ktc(storage, tmp / "stats-hit"),
        "tokens": args.tokens,
        "prompts": args.prompts,
        "pairs": args.pairs,
    }
    rows = _run_child("hit", spec, tmp)
    ratios = [c[0] / v[0] for c, v in zip(rows["connector"], rows["vllm"], strict=True)]
    aa = [a[0] / v[0] for a, v in zip(rows["vllm_aa"], rows["vllm"], strict=True)]
    med = {k: statistics.median(t for t, _ in v) for k, v in rows.items()}
    print(
        f"hit: {args.prompts} prompts x {args.tokens} tokens, {args.pairs} interleaved pairs "
        f"each, {args.tier} tier"
    )
    for label, key in (
        ("cold prefill", "cold"),
        ("vLLM prefix-cache hit", "vllm"),
        ("connector hit", "connector"),
    ):
        cached = sorted({c for _, c in rows[key]})
        print(f"  {label:<22} TTFT median {med[key] * 1e3:8.1f} ms   cached tokens {cached}")
    print(f"  connector / vLLM hit, per-pair ratios: {_verdict(ratios, aa, 1.2)}")
    _print_load_breakdown(tmp / "stats-hit", len(rows["connector"]))
    print(f"  cold / connector: {med['cold'] / med['connector']:.1f}x")


def scenario_disk(args: argparse.Namespace, base: dict[str, Any], tmp: Path) -> None:
    disk = tmp / "kv-disk"
    storage = {
        "chunk_size": args.chunk_size,
        "tiers": [{"name": "disk", "backend": "disk", "options": {"path": str(disk)}}],
    }
    stats = tmp / "stats-disk"
    spec = {
        **base,
        # (this scenario measures loads: a lookup slowed by a busy machine must not miss)
        "ktc": _ktc(storage, stats, lookup_deadline_ms=2000),
        "prefix_caching": True,
        "tokens": args.disk_chunks * args.chunk_size + 1,
        "reps": args.disk_reps,
        "disk": str(disk),
        "stats_dir": str(stats),
    }
    rows = _run_child("disk", spec, tmp, in_process=args.disk_in_process)
    w = statistics.median(rows["worker"]) / 1e9
    b = statistics.median(rows["backend"]) / 1e9
    ratios = [x / y for x, y in zip(rows["worker"], rows["backend"], strict=True)]
    reads = statistics.median(rows["worker_reads"]) / 1e9
    single = statistics.median(rows["single"]) / 1e9
    print(
        f"disk: one request loading {rows['chunks']} chunks of "
        f"{rows['chunk_bytes'] / 2**20:.1f} MiB, page cache dropped, {args.disk_reps} "
        "interleaved repetitions"
    )
    mode = "in-process engine" if args.disk_in_process else "worker in its own process"
    print(f"  ({mode})")
    print(f"  worker, first read -> get_finished:  {w:.2f} GB/s (median)")
    print(f"  worker, first read -> last chunk in: {reads:.2f} GB/s (median)")
    print(f"  disk backend, one batched_get_into:  {b:.2f} GB/s (median)")
    print(f"  disk backend, one get_into per chunk, all at once: {single:.2f} GB/s (median)")
    print(f"  worker / backend batched: {w / b:.2f}x (per repetition {_spread(ratios)})")


class _Server:
    """A child engine process taking miss measurements on request (see _child_serve)."""

    def __init__(
        self, name: str, spec: dict[str, Any], tmp: Path, pythonpath: str | None = None
    ) -> None:
        spec_path = tmp / f"serve-{name}.spec.json"
        spec_path.write_text(json.dumps(spec))
        self.out = str(tmp / f"serve-{name}")
        self.log = open(tmp / f"serve-{name}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                "serve",
                "--spec",
                str(spec_path),
                "--out",
                self.out,
            ],
            env={
                **_env(True),
                "VLLM_CPU_KVCACHE_SPACE": "2",
                **({"PYTHONPATH": pythonpath} if pythonpath else {}),
            },
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.n = 0
        self._wait("READY")

    def _wait(self, marker: str) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip() == marker:
                return
        raise SystemExit(f"engine child exited; see {self.log.name}")

    def ask(self, what: str, seed: int) -> tuple[float, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{what} {seed}\n")
        self.proc.stdin.flush()
        self._wait(f"DONE {self.n}")
        first, saved = json.loads(Path(f"{self.out}.{self.n}.json").read_text())
        self.n += 1
        return float(first), float(saved)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


def scenario_miss(args: argparse.Namespace, base: dict[str, Any], tmp: Path) -> None:
    tiers: list[dict[str, Any]] = [
        {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "2GiB"}}
    ]
    if args.miss_tiers == "cpu+disk":
        tiers.append({"name": "disk", "backend": "disk", "options": {"path": str(tmp / "kv-miss")}})
    storage = {"chunk_size": args.chunk_size, "tiers": tiers}
    common = {**base, "tokens": args.miss_tokens, "batch_tokens": args.batch_tokens}
    # Two engines without the connector (the baseline and its A/A twin) and one with it,
    # alive together, each measured in every round in a random order.
    servers = {
        "none": _Server("none", {**common, "ktc": None}, tmp),
        "none2": _Server("none2", {**common, "ktc": None}, tmp),
        "connector": _Server(
            "connector", {**common, "ktc": _ktc(storage, tmp / "stats-miss")}, tmp
        ),
    }
    if args.miss_ref:  # the same connector, another version of lmcache_core
        ref_storage = {
            **storage,
            "tiers": [
                {**t, "options": {**t["options"], "path": str(tmp / "kv-miss-ref")}}
                if t["name"] == "disk"
                else t
                for t in tiers
            ],
        }
        servers["connector-ref"] = _Server(
            "connector-ref",
            {**common, "ktc": _ktc(ref_storage, tmp / "stats-miss-ref")},
            tmp,
            pythonpath=str(Path(args.miss_ref).resolve()),
        )
    rng = random.Random(3)
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {
        k: {"ttft": [], "batch": []} for k in servers
    }
    seeds = {"none": 0, "none2": 250, "connector": 500, "connector-ref": 750}
    t_start = time.monotonic()
    rounds = 0
    try:
        for rep in range(args.miss_reps):
            if rep >= args.miss_min_reps and time.monotonic() - t_start > args.miss_budget_s:
                break
            for what in ("ttft", "batch"):
                order = list(servers)
                rng.shuffle(order)
                for name in order:
                    time.sleep(0.3)  # let the other engines' threads go idle
                    seed = 1000 * rep + seeds[name] + (7 if what == "batch" else 0)
                    samples[name][what].append(servers[name].ask(what, seed))
            rounds += 1
    finally:
        for srv in servers.values():
            srv.close()

    print(
        f"miss ({args.miss_tiers} tiers): three engine processes alive together, two without "
        f"the connector (baseline and A/A twin) and one with it, each measured once per round "
        f"in random order ({rounds} rounds): TTFT of one unique {args.miss_tokens}-token "
        f"prompt, wall time of 20 unique {args.batch_tokens}-token prompts. Saves included: "
        "an engine's measurement ends once its saves are in every tier, so no store runs "
        "into another measurement"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "samples": samples}))
    for what, unit, scale in (("ttft", "ms", 1e3), ("batch", "s", 1.0)):
        none = [x for x, _ in samples["none"][what]]
        none2 = [x for x, _ in samples["none2"][what]]
        # The baseline of a round: the geometric mean of the two engines without the
        # connector (engine processes differ in speed by themselves; see the A/A).
        base = [(a * b) ** 0.5 for a, b in zip(none, none2, strict=True)]
        conn = [x for x, _ in samples["connector"][what]]
        conn_saved = [y for _, y in samples["connector"][what]]
        ratios = [c / n for c, n in zip(conn, base, strict=True)]
        aa = [c / n for c, n in zip(none2, none, strict=True)]
        durable = [c / n for c, n in zip(conn_saved, base, strict=True)]
        tail = [y - x for x, y in samples["connector"][what]]
        print(
            f"  {what:<5} medians: none {statistics.median(none) * scale:.1f} {unit}, "
            f"none2 {statistics.median(none2) * scale:.1f} {unit}, connector "
            f"{statistics.median(conn) * scale:.1f} {unit} (saves done "
            f"{statistics.median(tail) * 1e3:.0f} ms after the outputs, median)"
        )
        print(f"    connector / baseline, per round: {_verdict(ratios, aa, 1.05)}")
        if "connector-ref" in samples:
            ref = [x for x, _ in samples["connector-ref"][what]]
            rr = [c / n for c, n in zip(ref, base, strict=True)]
            print(
                f"    reference connector ({args.miss_ref}) median "
                f"{statistics.median(ref) * scale:.1f} {unit}; ref / baseline, per round: "
                f"{_verdict(rr, aa, 1.05)}"
            )
            cr = [c / r for c, r in zip(conn, ref, strict=True)]
            cmed, clo, chi = _median_ci(cr, seed=3)
            print(f"    connector / reference: median {cmed:.3f}x, 95% CI {clo:.3f}-{chi:.3f}x")
        dmed, dlo, dhi = _median_ci(durable, seed=2)
        print(
            f"    connector until its saves are in every tier / baseline: median {dmed:.3f}x, "
            f"95% CI {dlo:.3f}-{dhi:.3f}x"
        )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenario", choices=("all", "hit", "disk", "miss"), default="all")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2049)
    ap.add_argument("--pairs", type=int, default=25)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--tier", choices=("cpu", "disk"), default="cpu", help="hit scenario's tier")
    ap.add_argument("--disk-chunks", type=int, default=16)
    ap.add_argument("--disk-reps", type=int, default=5)
    ap.add_argument(
        "--disk-in-process",
        action="store_true",
        help="disk scenario: scheduler and worker in the driver process",
    )
    ap.add_argument("--miss-tokens", type=int, default=1025)
    ap.add_argument("--batch-tokens", type=int, default=513)
    ap.add_argument("--miss-tiers", choices=("cpu", "cpu+disk"), default="cpu+disk")
    ap.add_argument(
        "--miss-ref",
        metavar="DIR",
        help="miss: also measure the connector of another lmcache_core version, imported "
        "from DIR/lmcache_core (e.g. git archive COMMIT lmcache_core | tar -x -C DIR)",
    )
    ap.add_argument("--json", metavar="FILE", help="miss: write every sample to FILE")
    ap.add_argument("--miss-reps", type=int, default=30, help="miss: most rounds")
    ap.add_argument("--miss-min-reps", type=int, default=16, help="miss: fewest rounds")
    ap.add_argument(
        "--miss-budget-s",
        type=float,
        default=420.0,
        help="miss: no new round after this many seconds once --miss-min-reps are done",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        spec = json.loads(Path(args.spec).read_text())
        if args.child == "serve":
            _child_serve(spec, args.out)
            return 0
        fn = {"hit": _child_hit, "disk": _child_disk}[args.child]
        Path(args.out).write_text(json.dumps(fn(spec)))
        return 0

    from demo import _model_spec

    from lmcache_core.integrations.vllm.local_model import make_local_model

    spec_m = _model_spec()
    model = make_local_model(ROOT / ".models" / "demo-llama", spec_m)
    base = {"model": str(model), "vocab": spec_m.vocab_size}
    print(
        f"vLLM CPU, {spec_m.num_hidden_layers}-layer float32 model, chunk {args.chunk_size} tokens"
    )
    with tempfile.TemporaryDirectory(prefix="bench-vllm-", dir=str(ROOT / ".models")) as t:
        tmp = Path(t)
        for name, fn in (("hit", scenario_hit), ("disk", scenario_disk), ("miss", scenario_miss)):
            if args.scenario in ("all", name):
                t0 = time.monotonic()
                fn(args, base, tmp)
                print(f"  ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
