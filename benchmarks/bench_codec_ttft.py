"""Warm TTFT from a cold disk per KV codec, against a cold prefill, in fresh engines.

A lossy codec is worth shipping only if loading a prompt's KV from a disk tier through
it -- read the fewer bytes, decode -- gives the first token sooner than computing the
prompt. Every measurement is a **fresh engine process** (vLLM CPU, float32, scheduler and
worker in the process) that serves one warm-up request (another prompt: the process's
first-request costs stay out of the figure), waits for its saves, evicts the tier's
files from the page cache (``posix_fadvise(DONTNEED)`` after ``fsync``, only those files:
the machine is shared) and then times the first token of the measured prompt:

* ``cold``: the connector with an empty disk tier -- the prompt is computed (a miss), and
  ``cold-aa``, the same again: the A/A twin that shows the set-up's noise;
* ``raw``: the prompt's chunks on a disk tier without a codec;
* one row per codec (``--codec``, default the lossy first-party ones at their
  recommended settings): the chunks on a disk tier with that codec.

Each disk tier is filled once beforehand by its own engine process (the same prompt,
saves awaited). The measurements run in rounds, each round all variants in a random
order; per round the ratio of each variant's TTFT to that round's ``cold`` TTFT, and the
A/A ratio ``cold-aa / cold``; printed: medians with their spread (min-max over rounds).
Bytes read beside each: the bytes the tier's codec read (the coded chunks), and the
process's ``read_bytes`` from ``/proc/self/io`` over the measured request -- what the
block device delivered, which shows that the page cache was really dropped.

Run: ``.venv/bin/python benchmarks/bench_codec_ttft.py`` (about 5 minutes here with the
trained model of ``make model``; a random-weight demo model otherwise: TTFT does not
depend on the weights). Heavy: under ``flock /tmp/lmcache-heavy.lock`` on a shared machine.
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
#: The lossy codecs at their recommended settings (docs/codecs.md).
DEFAULT_CODECS = ["int8", "cachegen"]


# ---------------------------------------------------------------------------- child
def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def _drop_page_cache(root: str) -> int:
    from _util import drop_page_cache

    return drop_page_cache(root)


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from lmcache_core.cli.codec_quality import _connector_worker, wait_saves

    tier: dict[str, Any] = {"name": "disk", "backend": "disk", "options": {"path": spec["disk"]}}
    if spec.get("codec"):
        tier["codec"] = spec["codec"]
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=spec["max_model_len"],
        block_size=spec["chunk"],
        enable_prefix_caching=False,
        disable_log_stats=False,  # per-request metrics: first_token_latency
        kv_transfer_config={
            "kv_connector": "LMCacheCoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "config": {"chunk_size": spec["chunk"], "tiers": [tier]},
                # one request at a time: a lookup on a busy shared machine may pass the
                # default 20 ms and turn the hit into a miss, which this run refuses
                "lookup_deadline_ms": 1000.0,
            },
        },
    )
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(prompt: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        first = float(getattr(getattr(out, "metrics", None), "first_token_latency", 0.0) or 0.0)
        return (first if first > 0 else wall), int(out.num_cached_tokens or 0)

    res: dict[str, Any] = {}
    if spec["mode"] == "fill":
        ttft(spec["prompt"])
        res["pending"] = wait_saves()
    else:
        ttft(spec["warmup"])
        wait_saves()
        res["evicted_files"] = _drop_page_cache(spec["disk"])
        worker = _connector_worker()

        def codec_read() -> int:
            tiers = worker.storage.stats().get("tiers", []) if worker else []
            return int(sum((t.get("codec") or {}).get("coded_bytes_read", 0) for t in tiers))

        def loaded() -> int:
            return int(worker.stats()["loaded_bytes"]) if worker else 0

        before = (_read_bytes(), codec_read(), loaded())
        t0 = time.perf_counter()
        res["ttft_s"], res["hit_tokens"] = ttft(spec["prompt"])
        res["wall_s"] = time.perf_counter() - t0
        res["read_bytes"] = _read_bytes() - before[0]
        res["coded_bytes_read"] = codec_read() - before[1]
        res["loaded_bytes"] = loaded() - before[2]
        st = worker.stats() if worker else {}
        res["failed_chunks"] = int(st.get("failed_chunks", 0))
        # where a load's time went (cumulative over the process: the warm-up loaded nothing)
        res["load_breakdown_s"] = st.get("load_breakdown_seconds", {})
        res["async_load_throughput"] = st.get("async_load_throughput", [])[-1:]
    llm.llm_engine.engine_core.shutdown()
    return res


# ---------------------------------------------------------------------------- parent
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def _run_child(spec: dict[str, Any], tmp: Path, name: str) -> dict[str, Any]:
    spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    rc = subprocess.run(
        [sys.executable, __file__, "--child", str(spec_path), "--out", str(out_path)],
        env=_env(),
        capture_output=True,
        text=True,
    )
    if rc.returncode != 0:
        print(rc.stdout[-3000:], rc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{name}: engine process failed")
    out: dict[str, Any] = json.loads(out_path.read_text())
    return out


def _parse_codec(text: str) -> dict[str, Any]:
    name, sep, rest = text.partition(":")
    return {"name": name, "options": json.loads(rest) if sep else {}}


def _model(arg: str | None) -> tuple[str, bool]:
    """The model folder and whether it is the trained measuring model."""
    from lmcache_core.cli.bench_codecs import default_model

    path, trained = default_model()
    if arg:
        return arg, trained and Path(arg).resolve() == Path(path).resolve()
    return path, trained


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model folder (default: the trained model, else a demo one)")
    ap.add_argument("--codec", action="append", metavar="NAME[:JSON]", help="repeatable")
    ap.add_argument("--chunks", type=int, default=15, help="prompt chunks loaded (default 15)")
    ap.add_argument("--chunk", type=int, default=128, help="chunk and block size (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", help="also write the raw measurements here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        spec = json.loads(Path(args.child).read_text())
        Path(args.out).write_text(json.dumps(_child(spec)))
        return 0

    model, trained = _model(args.model)
    vocab = int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    rng = random.Random(args.seed)
    tokens = args.chunks * args.chunk + 1
    prompt = [rng.randrange(4, vocab) for _ in range(tokens)]
    codecs = [_parse_codec(c) for c in (args.codec or DEFAULT_CODECS)]
    base = {
        "model": model,
        "chunk": args.chunk,
        "max_model_len": -(-(tokens + 8) // args.chunk) * args.chunk,
        "prompt": prompt,
    }
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        tiers: dict[str, dict[str, Any] | None] = {"raw": None}
        for c in codecs:
            label = c["name"] + (f" {json.dumps(c['options'])}" if c["options"] else "")
            tiers[label] = c
        dirs: dict[str, Path] = {}
        t0 = time.monotonic()
        for i, (label, codec) in enumerate(tiers.items()):
            dirs[label] = tmp / f"tier{i}"
            res = _run_child(
                {**base, "mode": "fill", "disk": str(dirs[label]), "codec": codec}, tmp, f"fill{i}"
            )
            if res["pending"]:
                raise SystemExit(f"{label}: {res['pending']} stores still pending")
        sizes = {label: _dir_bytes(d) for label, d in dirs.items()}  # the prompt's chunks
        print(
            f"# {model} ({'trained' if trained else 'random-weight demo'}), prompt {tokens} "
            f"tokens ({args.chunks} chunks of {args.chunk}); tiers filled in "
            f"{time.monotonic() - t0:.0f} s",
            flush=True,
        )
        variants = ["cold", "cold-aa", *tiers]
        rows: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        order_rng = random.Random(args.seed + 1)
        for r in range(args.rounds):
            order = list(variants)
            order_rng.shuffle(order)
            for v in order:
                if v.startswith("cold"):
                    disk, codec = tmp / f"empty-{v}-{r}", None
                else:
                    disk, codec = dirs[v], tiers[v]
                warm = [rng.randrange(4, vocab) for _ in range(tokens)]
                spec = {
                    **base,
                    "mode": "measure",
                    "disk": str(disk),
                    "codec": codec,
                    "warmup": warm,
                }
                res = _run_child(spec, tmp, f"m{r}-{variants.index(v)}")
                want = 0 if v.startswith("cold") else args.chunks * args.chunk
                if res["hit_tokens"] != want:
                    raise SystemExit(f"{v}: {res['hit_tokens']} hit tokens, expected {want}")
                rows[v].append(res)
            print(f"# round {r + 1}/{args.rounds} done", flush=True)
            if args.json:  # after every round: a cut-short run keeps what it measured
                Path(args.json).write_text(json.dumps({"sizes": sizes, "rows": rows}, indent=1))
    cold = [x["ttft_s"] for x in rows["cold"]]
    aa = [b["ttft_s"] / a["ttft_s"] for a, b in zip(rows["cold"], rows["cold-aa"], strict=True)]
    print(
        f"\n{args.rounds} rounds, each variant in a fresh engine process, random order per "
        f"round; ratios to the same round's cold TTFT (median, min-max); A/A (cold-aa / cold): "
        f"{statistics.median(aa):.2f}x ({min(aa):.2f}-{max(aa):.2f}x)\n"
    )
    print(
        "| variant | TTFT ms (median) | x cold (median, min-max) | tier bytes on disk | "
        "coded bytes read | read_bytes from the device |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for v in variants:
        t = [x["ttft_s"] for x in rows[v]]
        ratio = [a / c for a, c in zip(t, cold, strict=True)]
        size = f"{sizes[v]:,}" if v in sizes else "-"
        coded = statistics.median(x["coded_bytes_read"] for x in rows[v])
        if v == "raw":
            coded = statistics.median(x["loaded_bytes"] for x in rows[v])
        dev = statistics.median(x["read_bytes"] for x in rows[v])
        print(
            f"| {v} | {statistics.median(t) * 1e3:.1f} | {statistics.median(ratio):.2f}x "
            f"({min(ratio):.2f}-{max(ratio):.2f}x) | {size} | "
            f"{'-' if v.startswith('cold') else f'{coded:,.0f}'} | {dev:,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
