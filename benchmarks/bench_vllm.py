"""LMCacheCoreConnector on vLLM (CPU): what a hit costs, what a miss costs, and how fast
the worker loads from disk -- each against a baseline measured in the same run.

Scenarios (``--scenario``, default all), on the demo's model (8-layer float32 Llama):

* ``hit``: time to first token of a prompt whose KV is in the connector's CPU tier,
  against vLLM's own prefix-cache hit on the same prompt: per pair, a vLLM hit, a second
  vLLM hit (the A/A twin) and a connector hit (after ``reset_prefix_cache()``) in random
  order; the median of the per-pair ratios with a 95% bootstrap interval (the connector
  hit against the pair's vLLM hit, and against the geometric mean of both of the pair's
  vLLM hits), beside the same for vLLM's hit against itself. Target: <= 1.2x.
  ``--hit-in-process`` also times the connector's hooks on the engine thread, per hook.
  ``--ref DIR`` (repeatable): one engine per version (this tree, each ``DIR`` on
  ``PYTHONPATH``) alive together, each measuring one pair per round, the versions in
  random order per round; each version's ratio, and this tree's / each ref's per round
  (a ref that is a copy of this tree gives an A/A between engine processes).
* ``disk``: one request loading N chunks from a disk-only tier on an idle in-process
  engine, page cache dropped for the tier's files (``posix_fadvise``): bytes / (first
  read issued -> ``get_finished`` reported), from the worker's statistics; against the
  disk backend's own ``batched_get_into`` of the same N chunks, same batch and
  concurrency, page cache dropped, interleaved. Target: >= 0.7x.
* ``miss``: the connector's cost when nothing hits (CPU + disk tiers, saves included):
  TTFT of a unique prompt and the wall time of a 20-request batch of unique prompts.
  Default (``--miss-design toggle``): one in-process engine whose connector is switched
  on and off between measurements (off, its scheduler side reports no hit and plans
  nothing; vLLM still calls every hook), per round in random order: on, off, off again
  (the A/A twin) and, with ``--miss-on0`` when the copy threads run nicer than vLLM, on
  with them at vLLM's priority, and with ``--miss-idle-arm`` on with every ``lmcache-*``
  thread but the IO loop at ``SCHED_IDLE`` (root only); TTFT in
  ``--miss-ttft-per-round`` sub-rounds per round,
  each its own ratio sample; it also times the connector's hooks on the engine thread and the CPU time
  of the process's other Python threads. ``--miss-design engines``: engine processes
  with and without the connector alive together (two identical processes measured 15%
  apart here, so this design cannot judge 5%). A measurement ends only once its saves
  are in every tier. Per-round ratios against the geometric mean of the two baseline
  measurements, medians with 95% bootstrap intervals. Target: <= 1.05x.

* ``itl``: what a request arriving in the middle of another's decoding costs that
  decoding request: its inter-token latencies over the ``--itl-window`` tokens after the
  arrival, per round in random order with nothing arriving (``base``, and ``base2``, the
  A/A twin), a request of ``--disk-chunks`` chunks found on disk only (page cache
  dropped: the connector loads it in the background, ``hit``), the same found in the
  cpu tier (``memhit``, with ``--itl-tiers cpu+disk``, the default: its chunks were read
  back from disk and promoted just before, so it loads before the forward pass), and a
  unique prompt of that length (prefilled and saved, ``cold``); ratios of each arm's
  mean, median and largest gap to ``base``'s, the arriving request's TTFT, the gaps one
  by one and the connector's hook time in the first gaps. No target: it shows what
  loading off the step buys against a cold prefill and what a load still costs the
  decoding request on shared cores.

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
import dataclasses
import itertools
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:  # imports vLLM: loaded by the processes that run engines only
    from lmcache_core.integrations.vllm.worker_side import WorkerSide

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
    timer = None
    if spec.get("in_process"):  # the connector's time on the engine thread, per hit
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
        timer = _HookTimer(sched, get_kv_transfer_group())
    _ttft(llm, list(range(4, 300)))
    rows: dict[str, list[Any]] = {"cold": [], "vllm": [], "connector": [], "vllm_aa": []}
    hooks: dict[str, list[float]] = {k: [] for k in rows}
    by_hook: dict[str, list[dict[str, float]]] = {k: [] for k in rows}
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
                h0 = timer.seconds if timer is not None else 0.0
                b0 = dict(timer.by_hook) if timer is not None else {}
                rows[what].append(_ttft(llm, p))
                if timer is not None:
                    hooks[what].append(timer.seconds - h0)
                    by_hook[what].append({k: v - b0.get(k, 0.0) for k, v in timer.by_hook.items()})
    llm.llm_engine.engine_core.shutdown()
    return {**rows, "hooks": hooks, "by_hook": by_hook} if timer is not None else rows


_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _sys_snapshot() -> dict[str, float]:
    """Where every core's time went so far, in seconds (``--miss-sys-split``): the
    machine's ``/proc/stat`` counters (all CPUs: user, system, idle, iowait, ...), this
    process's CPU (``/proc/self/stat``), kernel threads' CPU by kind (``kthread:jbd2``,
    ``kthread:kworker``, ``kthread:ksoftirqd``, ``kthread:other``; ``/proc/<pid>/stat``
    utime + stime of every process flagged ``PF_KTHREAD``) and every other process's
    (``others``). Clock ticks, so 10 ms resolution per counter."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    with open("/proc/stat", encoding="ascii") as f:
        fields = f.readline().split()[1:]
    for name, v in zip(_STAT_FIELDS, fields, strict=False):
        out[f"cpu:{name}"] = int(v) / tick
    # run-queue delay (runnable, not running) of this process's threads, by kind
    import threading

    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    main = threading.main_thread().native_id
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
                delay = int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
        tname = names.get(int(tid))
        kind = (
            "main"
            if int(tid) == main
            else "lmcache"
            if tname and tname.startswith("lmcache")
            else "python"
            if tname
            else "native"
        )
        out[f"rq:{kind}"] = out.get(f"rq:{kind}", 0.0) + delay
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                raw = f.read()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1 : raw.rindex(")")]
        rest = raw[raw.rindex(")") + 2 :].split()
        flags, utime, stime = int(rest[6]), int(rest[11]), int(rest[12])
        secs = (utime + stime) / tick
        if int(pid) == me:
            key = "self"
        elif flags & 0x00200000:  # PF_KTHREAD
            kind = comm.split("/")[0]
            key = f"kthread:{kind}" if kind in ("jbd2", "kworker", "ksoftirqd") else "kthread:other"
        else:
            key = "others"
        out[key] = out.get(key, 0.0) + secs
    return out


def _sys_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}


def _drop_page_cache(root: str) -> int:
    from _util import drop_page_cache

    return drop_page_cache(root)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process, by name: Python threads by their
    name with digits stripped (``lmcache-scatter_`` for all scatter threads), the main
    thread as ``main``, the others (vLLM's and torch's native threads) as ``os:<comm>``."""
    import re
    import threading

    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    main = threading.main_thread().native_id
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            secs = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
        n = int(tid)
        name = "main" if n == main else names.get(n)
        key = re.sub(r"\d+", "_", name) if name else f"os:{comm}"
        out[key] = out.get(key, 0.0) + secs
    return out


def _child_disk(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from lmcache_backend_disk.aligned import aligned_empty
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
    first = backend.get(keys[0])
    assert first is not None, "the first chunk is not in the disk tier"
    shape = first.shape
    outs = [torch.empty(shape, dtype=torch.float32) for _ in keys]
    # (page-aligned, as the worker's load buffers are: O_DIRECT reads land in them directly)
    aligned = [aligned_empty(shape, torch.float32) for _ in keys]
    # In-process: each thread's CPU time from the load's start to its report (the
    # worker's AsyncLoads wrapped), and the engine steps (get_finished calls) in between.
    marks: dict[str, Any] = {}
    if spec.get("in_process"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        w = _worker_side(get_kv_transfer_group())
        loads = w.loads
        assert loads is not None, "no asynchronous loads on this worker"
        start, finish, get_finished = loads.start, loads._finish, w.get_finished
        calls = [0]

        def timed_start(*a: Any, **kw: Any) -> Any:
            marks["start"], marks["calls"] = _thread_cpu(), calls[0]
            return start(*a, **kw)

        def timed_finish(*a: Any, **kw: Any) -> Any:
            res = finish(*a, **kw)
            if "start" in marks:
                marks["end"], marks["steps"] = _thread_cpu(), calls[0] - marks["calls"]
            return res

        def counted(*a: Any, **kw: Any) -> Any:
            calls[0] += 1
            return get_finished(*a, **kw)

        # instrumentation: the worker's own methods, wrapped for this measurement
        loads.start, loads._finish = timed_start, timed_finish  # type: ignore[method-assign]
        w.get_finished = counted  # type: ignore[method-assign]
    rows: dict[str, list[Any]] = {
        "worker": [],
        "worker_reads": [],
        "backend": [],
        "single": [],
        "aligned": [],
    }
    for _ in range(spec["reps"]):
        if spec.get("reset_connector"):
            llm.reset_prefix_cache(reset_connector=True)
            time.sleep(0.5)  # the workers clear their memory tier at their next step
            _ttft(llm, list(range(5, 40)))  # (that step)
        else:
            llm.reset_prefix_cache()
        _drop_page_cache(spec["disk"])
        marks.clear()
        _, cached = _ttft(llm, prompt)
        if "end" in marks:
            cpu0, cpu1 = marks["start"], marks["end"]
            rows.setdefault("thread_cpu", []).append(
                {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items() if v - cpu0.get(k, 0.0) > 0}
            )
            rows.setdefault("steps", []).append(marks["steps"])
        assert cached >= len(keys) * ns.chunk_size - 1, cached
        worker = stats("worker")
        nbytes, secs, reads = worker["async_load_throughput"][-1]
        if worker.get("async_load_spans_ms"):
            rows.setdefault("spans", []).append(worker["async_load_spans_ms"][-1])
        rows["worker"].append(nbytes / secs)
        rows["worker_reads"].append(nbytes / reads)
        # the same chunks read by the backend: one batched call (its own concurrency) ...
        _drop_page_cache(spec["disk"])
        t0 = time.perf_counter()
        assert all(backend.batched_get_into(keys, outs))
        rows["backend"].append(sum(o.numel() * 4 for o in outs) / (time.perf_counter() - t0))
        _drop_page_cache(spec["disk"])
        t0 = time.perf_counter()
        assert all(backend.batched_get_into(keys, aligned))
        rows["aligned"].append(sum(o.numel() * 4 for o in outs) / (time.perf_counter() - t0))
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


def _child_itl(spec: dict[str, Any]) -> dict[str, Any]:
    """A decoding request's inter-token latency while another request arrives, per round
    in random order: ``base`` (nothing arrives), ``base2`` (the same: the A/A twin),
    ``hit`` (a request whose chunks are on disk only, page cache dropped: it loads in
    the background), ``cold`` (a unique prompt of the same length: prefilled, saved) and,
    with a cpu tier above the disk, ``memhit`` (a request whose chunks are in the cpu
    tier: loaded before the forward pass, inside the step). Every arm resets vLLM's
    prefix cache, empties the cpu tier and drops the disk tier's files from the page
    cache first (``memhit`` then reads its chunks back into the cpu tier, unrecorded)."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    llm = _llm(spec)
    engine = llm.llm_engine
    worker = _worker_side(get_kv_transfer_group())
    timer = _HookTimer(engine.engine_core.engine_core.scheduler.connector, get_kv_transfer_group())
    hit_prompt, mem_prompt = _prompts(spec, 2, spec["tokens"], 21)
    (dec_prompt,) = _prompts(spec, 1, 64, 22)
    fresh = iter(_prompts(spec, spec["rounds"] + 1, spec["tokens"], 23))
    with_cpu = spec["tiers"] == "cpu+disk"
    _ttft(llm, hit_prompt)  # cold: their chunks are stored
    _ttft(llm, mem_prompt)
    _ttft(llm, next(fresh))  # (a first cold prefill of this length, unrecorded)
    _wait_saves()
    full = (spec["tokens"] // spec["chunk_size"]) * spec["chunk_size"]
    dec_sp = SamplingParams(max_tokens=spec["decode_tokens"], temperature=0.0, ignore_eos=True)
    other_sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    after = spec["start_after"]

    def loaded() -> tuple[int, int]:
        """Chunks this worker loaded so far: before the forward pass, in the background."""
        ld = worker.loads
        return worker.counters.loaded_chunks, ld.loaded_chunks if ld is not None else 0

    def measure(arm: str, n: int) -> dict[str, Any]:
        if with_cpu:
            llm.reset_prefix_cache(reset_connector=True)
            time.sleep(0.5)  # the worker clears its memory tier at its next step
            _ttft(llm, list(range(5, 40)))  # (that step)
            if arm == "memhit":
                _drop_page_cache(spec["disk"])
                _ttft(llm, mem_prompt)  # read back from disk into the cpu tier
                _wait_saves()
        llm.reset_prefix_cache()
        _drop_page_cache(spec["disk"])
        dec, other = f"dec-{arm}-{n}", f"other-{arm}-{n}"
        engine.add_request(dec, TokensPrompt(prompt_token_ids=dec_prompt), dec_sp)
        stamps: list[float] = []
        hooks: list[dict[str, float]] = []  # the connector's hook time at each token
        added = first = 0.0
        cached = -1
        before = loaded()
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id == dec and len(o.outputs[0].token_ids) > len(stamps):
                    stamps.append(now)
                    hooks.append(dict(timer.by_hook))
                elif o.request_id == other and o.outputs[0].token_ids and not first:
                    first, cached = now, int(o.num_cached_tokens or 0)
            if len(stamps) == after and not added and arm in ("hit", "memhit", "cold"):
                p = {"hit": hit_prompt, "memhit": mem_prompt}.get(arm) or next(fresh)
                engine.add_request(other, TokensPrompt(prompt_token_ids=p), other_sp)
                added = time.perf_counter()
        _wait_saves()
        after_ = loaded()
        itl = [b - a for a, b in itertools.pairwise(stamps)]
        gaps = [
            {k: v - a.get(k, 0.0) for k, v in b.items() if v - a.get(k, 0.0) > 0}
            for a, b in itertools.pairwise(hooks)
        ]
        return {
            "itl": itl[after - 1 : after - 1 + spec["window"]],
            "hooks": gaps[after - 1 : after - 1 + 8],
            "ttft": first - added if added else None,
            "cached": cached,
            "sync_chunks": after_[0] - before[0],
            "async_chunks": after_[1] - before[1],
        }

    rng = random.Random(5)
    names = ["base", "base2", "hit", "cold"] + (["memhit"] if spec["memhit"] else [])
    rows: dict[str, list[dict[str, Any]]] = {a: [] for a in names}
    measure("warm", 0)
    for n in range(spec["rounds"]):
        arms = list(rows)
        rng.shuffle(arms)
        for arm in arms:
            rows[arm].append(measure(arm, n))
    for arm in ("hit", "memhit"):
        for r in rows.get(arm, []):
            assert r["cached"] >= full - 1, f"the {arm} request was not a hit: {r['cached']}"
    for r in rows["cold"]:
        assert r["cached"] == 0, f"the cold request hit: {r['cached']} cached"
    llm.llm_engine.engine_core.shutdown()
    return {"rows": rows}


def _wait_saves(timeout: float = 60.0) -> float:
    """Wait until every save has reached every tier; seconds waited."""
    from lmcache_core.integrations.vllm.in_process import wait_for_saves

    return wait_for_saves(timeout)


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


def _child_hitserve(spec: dict[str, Any], out_prefix: str) -> None:
    """An engine taking hit measurements on request, one per line of stdin (``--ref``:
    engines of several versions alive together, their pairs interleaved): ``prep I``
    (prompt ``I``'s cold prefill, then one unrecorded vLLM hit once its chunks are
    stored) or ``pair I SEED`` (a vLLM hit, its A/A twin and a connector hit of prompt
    ``I``, in an order drawn from ``SEED``), answering ``DONE n`` once the result is in
    ``<out_prefix>.<n>.json``."""
    import lmcache_core

    llm = _llm(spec)
    _ttft(llm, list(range(4, 300)))
    prompts = _prompts(spec, spec["prompts"], spec["tokens"], 7)
    print("READY", flush=True)
    for n, line in enumerate(sys.stdin):
        what, *rest = line.split()
        res: Any
        if what == "prep":
            p = prompts[int(rest[0])]
            res = {"cold": _ttft(llm, p)}
            time.sleep(1.0)
            _ttft(llm, p)
        elif what == "pair":
            p = prompts[int(rest[0])]
            order = ["vllm", "vllm_aa", "connector"]
            random.Random(int(rest[1])).shuffle(order)
            res = {}
            for m in order:
                if m == "connector":
                    llm.reset_prefix_cache()
                res[m] = _ttft(llm, p)
        elif what == "where":
            res = {"lmcache_core": str(Path(lmcache_core.__file__).resolve())}
        else:
            break
        Path(f"{out_prefix}.{n}.json").write_text(json.dumps(res))
        print(f"DONE {n}", flush=True)
    llm.llm_engine.engine_core.shutdown()


class _HookTimer:
    """Time spent inside the connector's methods (both roles: in-process engine, so
    all on the engine's thread), and the CPU time of the process's other Python threads
    (the connector's IO loop, disk and copy pools; vLLM's compute threads are not Python
    threads)."""

    SCHED = (
        "get_num_new_matched_tokens",
        "on_new_request",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
        "request_finished_all_groups",
        "get_external_cache_hit_sources",
        "get_kv_connector_stats",
        "take_events",
    )
    WORKER = (
        "handle_preemptions",
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
        "get_kv_connector_stats",
    )

    def __init__(self, sched: Any, worker: Any) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.by_hook: dict[str, float] = {}  # seconds per hook name
        for obj, names in ((sched, self.SCHED), (worker, self.WORKER)):
            for name in names:
                fn = getattr(obj, name, None)
                if fn is not None:
                    setattr(obj, name, self.timed(fn, name))

    def timed(self, fn: Any, name: str | None = None) -> Any:
        """``fn`` with its time added to :attr:`seconds` (and to ``by_hook[name]``)."""
        key: str = name or str(getattr(fn, "__name__", "?"))

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dt = time.perf_counter() - t0
                self.seconds += dt
                self.by_hook[key] = self.by_hook.get(key, 0.0) + dt
                self.calls += 1

        return timed

    @staticmethod
    def other_threads_cpu() -> float:
        """CPU seconds of every live Python thread but the main one."""
        import threading

        main = threading.main_thread().ident
        total = 0.0
        for t in threading.enumerate():
            if t.ident is None or t.ident == main:
                continue
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except (OSError, ProcessLookupError):
                continue
        return total


class _ConnectorSwitch:
    """Turns the connector's work off and on between measurements of one in-process
    engine: off, its scheduler side reports no hit and plans nothing (vLLM still calls
    every hook, which then finds nothing to do), so the worker loads and saves nothing.
    Switched only while the engine is idle and every save has landed."""

    def __init__(self, sched: Any) -> None:
        from lmcache_core.integrations.vllm.metadata import StepMetadata

        self.sched = sched
        self.on = True
        self._real = {
            n: getattr(sched, n)
            for n in (
                "get_num_new_matched_tokens",
                "on_new_request",
                "update_state_after_alloc",
                "build_connector_meta",
                "request_finished",
                "request_finished_all_groups",
            )
        }
        self._off: dict[str, Any] = {
            "get_num_new_matched_tokens": lambda request, n: (0, False),
            "on_new_request": lambda request: None,
            "update_state_after_alloc": lambda request, blocks, n: None,
            "build_connector_meta": lambda scheduler_output: StepMetadata(step=-1),
            "request_finished": lambda request, block_ids: (False, None),
            "request_finished_all_groups": lambda request, block_ids: (False, None),
        }

    def wrap(self, wrapper: Any) -> None:
        """Wrap both arms' methods (e.g. in a timer)."""
        self._real = {n: wrapper(f, n) for n, f in self._real.items()}
        self._off = {n: wrapper(f, n) for n, f in self._off.items()}

    def set(self, on: bool) -> None:
        for name, fn in (self._real if on else self._off).items():
            setattr(self.sched, name, fn)
        self.on = on


def _copy_threads(worker: Any) -> list[int]:
    """Native ids of the worker storage's copy threads, all started (see
    ``Storage(copy_nice=...)``); none when they run at vLLM's priority."""
    import threading

    from lmcache_core.integrations.vllm.storage import COPY_THREAD_PREFIX

    storage = _worker_side(worker).storage
    assert storage is not None, "the worker has no storage"
    barrier = threading.Barrier(4, timeout=5)

    async def start_all() -> None:
        await asyncio.gather(*(asyncio.to_thread(barrier.wait) for _ in range(4)))

    storage.sync.io.run(start_all())
    return [
        t.native_id
        for t in threading.enumerate()
        if t.name.startswith(COPY_THREAD_PREFIX) and t.native_id is not None
    ]


def _background_idle(idle: bool) -> None:
    """Arm ``onidle`` (``--miss-idle-arm``): every ``lmcache-*`` thread but the IO loop at
    ``SCHED_IDLE`` (only idle CPU), or back at ``SCHED_OTHER`` (the nice value stays; a
    thread started meanwhile by an idle one inherited its policy). Needs root to switch
    back."""
    import threading

    for t in threading.enumerate():
        tid = t.native_id
        if tid is None or not t.name.startswith("lmcache-") or t.name == "lmcache-io":
            continue
        try:
            if idle:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            elif os.sched_getscheduler(tid) == os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            continue


def _child_toggle(spec: dict[str, Any]) -> dict[str, Any]:
    """Miss overhead in one in-process engine: per round, the connector on, off, and off
    again (the A/A twin), in random order, for one unique prompt's TTFT and a batch of 20
    unique prompts (and, when its copy threads run nicer than vLLM, the connector on with
    them at vLLM's priority: arm ``on0``). Each measurement ends once the saves are in
    every tier."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    llm = _llm(spec)
    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker = get_kv_transfer_group()
    switch = _ConnectorSwitch(sched)
    timer = _HookTimer(sched, worker)
    switch.wrap(timer.timed)  # both arms' scheduler hooks timed the same way
    _ttft(llm, list(range(4, 300)))
    _wait_saves()
    # Unrecorded batches with the connector on first (--miss-warm-batches): they fill the
    # cpu tier, so the rounds measure it recycling evicted buffers, as a server does
    # after its warm-up, not filling fresh memory.
    warm_sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for w in range(spec.get("warm_batches", 0)):
        warm = _prompts(spec, 20, spec["batch_tokens"], 10**6 + w)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in warm], warm_sp, use_tqdm=False)
        _wait_saves()
    copy_tids = _copy_threads(worker)
    base_nice = os.getpriority(os.PRIO_PROCESS, 0)
    nices = {t: os.getpriority(os.PRIO_PROCESS, t) for t in copy_tids}
    if spec.get("nice") is not None:
        # (--miss-nice: the disk tier's pool threads too, as niced as the copy threads)
        import threading

        for th in threading.enumerate():
            tid = th.native_id
            if tid is not None and th.name.startswith("lmcache-disk") and tid not in nices:
                nices[tid] = os.getpriority(os.PRIO_PROCESS, tid)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rng = random.Random(3)
    arms = ["on", "off", "off2"]
    if spec.get("on0") and any(n != base_nice for n in nices.values()):
        arms.append("on0")
    if spec.get("idle_arm"):
        arms.append("onidle")
    # Arm 'onub' (--miss-unbatched-arm): the connector on with its lower tiers' background
    # stores one put per chunk (write queues' max_batch 1), as before batched stores.
    # The worker's internals, reached dynamically: this benchmark also runs older
    # versions of lmcache_core (PYTHONPATH), where some of these attributes do not exist.
    hierarchy: Any = getattr(_worker_side(worker).storage, "hierarchy", None)
    writers = [t.writer for t in hierarchy.tiers[1:]]
    batch_sizes = [getattr(w, "max_batch", 1) for w in writers]  # (older versions: none)
    if spec.get("unbatched_arm"):
        arms.append("onub")
    # Arm 'onnosync' (--miss-nosync-arm): the connector on with its disk tier's flushes off
    # (the backend's ``fsync: false``: no fdatasync of objects, no directory fsyncs).
    disks = [
        t.backend
        for t in hierarchy.tiers
        if hasattr(t.backend, "opts") and hasattr(getattr(t.backend, "opts", None), "fsync")
    ]
    disk_opts = [(d, d.opts, d.io.durable) for d in disks]
    if spec.get("nosync_arm"):
        assert disks, "no disk tier with an fsync option"
        arms.append("onnosync")
    # Arm 'oncpu' (--miss-cpuonly-arm): the connector on with its lower tiers' write policy
    # set to 'none' (no write-through at all: stores go to the cpu tier only).
    lower = list(hierarchy.tiers[1:])
    policies = [t.policy for t in lower]
    if spec.get("cpuonly_arm"):
        arms.append("oncpu")
    # Arm 'onnowait' (--miss-nowait-arm): the connector on, its scheduler's first poll of
    # a running shared-tier lookup answering "not yet" at once (first_wait_s 0, as before).
    lookups: Any = getattr(getattr(sched, "_scheduler", None), "lookups", None)
    first_wait = getattr(lookups, "first_wait_s", None)
    if spec.get("nowait_arm"):
        assert first_wait is not None, "no first-poll wait in this version"
        arms.append("onnowait")
    saves: Any = _worker_side(worker).saves
    real_submit = saves.submit
    submits: dict[str, Any] = {}  # arm -> what the worker's saves.submit is in it
    if spec.get("split_arms"):
        arms += ["plan", "gather"]
        scratch = saves.buffers.take()

        def gather_only(items: list[Any]) -> list[Any]:
            for it in items:  # the gathers, into one reused buffer; nothing stored
                saves.copier.gather_to_host(it.block_ids, scratch, it.other_blocks)
            return []

        submits = {"plan": lambda items: [], "gather": gather_only}

    out: dict[str, Any] = {w: {a: [] for a in arms} for w in ("ttft", "batch")}
    seeds = {
        "on": 0,
        "off": 250,
        "off2": 500,
        "on0": 750,
        "onidle": 875,
        "plan": 125,
        "gather": 375,
        "onub": 625,
        "onnosync": 937,
        "oncpu": 62,
        "onnowait": 312,
    }
    t_start = time.monotonic()
    rounds = 0
    for rep in range(spec["reps"]):
        if rep >= spec["min_reps"] and time.monotonic() - t_start > spec["budget_s"]:
            break
        # TTFT measurements are short: several sub-rounds per round, each a ratio sample
        subs = [("ttft", k) for k in range(spec.get("ttft_per_round", 1))] + [("batch", 0)]
        for what, sub in subs:
            order = list(arms)
            rng.shuffle(order)
            for arm in order:
                switch.set(arm not in ("off", "off2"))  # every other arm has it on
                saves.submit = submits.get(arm, real_submit)
                for wq, n in zip(writers, batch_sizes, strict=True):
                    wq.max_batch = 1 if arm == "onub" else n
                for t, pol in zip(lower, policies, strict=True):
                    t.policy = "none" if arm == "oncpu" else pol
                if first_wait is not None:
                    lookups.first_wait_s = 0.0 if arm == "onnowait" else first_wait
                for d, o, durable in disk_opts:
                    nosync = arm == "onnosync"
                    d.opts = dataclasses.replace(o, fsync=False) if nosync else o
                    d.io.durable = False if nosync else durable
                for t, n in nices.items():
                    os.setpriority(os.PRIO_PROCESS, t, base_nice if arm == "on0" else n)
                if "onidle" in arms:
                    _background_idle(arm == "onidle")
                time.sleep(0.3)  # let the connector's threads go idle
                seed = 1000 * rep + seeds[arm] + (7 if what == "batch" else 11 * sub)
                hook0, cpu0 = timer.seconds, timer.other_threads_cpu()
                by0 = dict(timer.by_hook)
                sys0 = _sys_snapshot() if spec.get("sys_split") and what == "batch" else None
                t0 = time.perf_counter()
                if what == "ttft":
                    (p,) = _prompts(spec, 1, spec["tokens"], seed)
                    first, cached = _ttft(llm, p)
                    assert cached == 0, cached
                else:
                    batch = [
                        TokensPrompt(prompt_token_ids=p)
                        for p in _prompts(spec, 20, spec["batch_tokens"], seed)
                    ]
                    outs = llm.generate(batch, sp, use_tqdm=False)
                    assert all(o.num_cached_tokens == 0 for o in outs)
                    first = time.perf_counter() - t0
                done = time.perf_counter() - t0
                sys1 = _sys_snapshot() if sys0 is not None else None
                saved = done + _wait_saves()
                row: dict[str, Any] = {
                    "first": first,
                    "saved": saved,
                    "hooks": timer.seconds - hook0,
                    "threads_cpu": timer.other_threads_cpu() - cpu0,
                    "by_hook": {k: v - by0.get(k, 0.0) for k, v in timer.by_hook.items()},
                }
                if sys0 is not None and sys1 is not None:
                    row["sys"] = _sys_delta(sys0, sys1)  # t0 -> the outputs
                    row["sys_wall"] = done
                out[what][arm].append(row)
        rounds += 1
    switch.set(True)
    out["rounds"] = rounds
    out["copy_nice"] = sorted(set(nices.values()))
    out["stats"] = _worker_side(worker).stats()
    import lmcache_core

    out["code"] = [lmcache_core.__file__]
    try:
        import lmcache_backend_disk

        out["code"].append(lmcache_backend_disk.__file__)
    except ImportError:
        pass
    llm.llm_engine.engine_core.shutdown()
    return out


# ---------------------------------------------------------------------------- parent
def _env(in_process: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    return env


def _run_child(
    kind: str,
    spec: dict[str, Any],
    tmp: Path,
    in_process: bool = False,
    pythonpath: str | None = None,
    tag: str = "",
) -> Any:
    spec_path, out_path = tmp / f"{kind}{tag}.spec.json", tmp / f"{kind}{tag}.out.json"
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
        env={**_env(in_process), **({"PYTHONPATH": pythonpath} if pythonpath else {})},
        capture_output=True,
        text=True,
    )
    if rc.returncode != 0:
        print(rc.stdout[-3000:], rc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{kind} child failed")
    return json.loads(out_path.read_text())


def _ktc(storage: dict[str, Any], stats: Path | None, **options: Any) -> dict[str, Any]:
    """The connector's configuration; ``stats``: its ``stats_dir`` (off by default in the
    connector: a file written every step costs the engine thread ~1 ms)."""
    extra: dict[str, Any] = {"config": storage, **options}
    if stats is not None:
        extra["stats_dir"] = str(stats)
    return {
        "kv_connector": "LMCacheCoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}x" if xs else "-"


def _median_ci(xs: list[float], seed: int = 0, n: int = 4000) -> tuple[float, float, float]:
    """Median of ``xs`` and a 95% bootstrap interval of it (the median's uncertainty)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return statistics.median(xs), meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def _ci_text(xs: list[float], seed: int = 0) -> str:
    """``median ...x, 95% CI ...-...x`` of the ratios ``xs`` (:func:`_median_ci`)."""
    med, lo, hi = _median_ci(xs, seed=seed)
    return f"median {med:.3f}x, 95% CI {lo:.3f}-{hi:.3f}x"


def _worker_side(connector: object) -> WorkerSide:
    """The worker half of an in-process engine's connector."""
    side = getattr(connector, "_worker", None)
    assert side is not None, f"no worker side in {connector!r}"
    return cast("WorkerSide", side)


def _verdict_word(lo: float, hi: float, alo: float, ahi: float, target: float) -> str:
    """``met`` / ``not met`` when the ratio's interval ``lo-hi`` lies on one side of the
    target, else ``within noise``; ``within noise`` too when the A/A interval ``alo-ahi``
    excludes 1."""
    if not alo <= 1.0 <= ahi:
        return "within noise (the A/A interval excludes 1)"
    return "met" if hi <= target else "not met" if lo > target else "within noise"


def _verdict(ratio: list[float], aa: list[float], target: float) -> str:
    """``met`` / ``not met`` when the median's 95% interval lies on one side of the
    target, else ``within noise``; also ``within noise`` when the A/A median's interval
    (the same measurement against itself) excludes 1: the set-up is then biased by more
    than its interval shows (e.g. two identical engine processes running at different
    speeds), and no verdict at the target's scale holds."""
    med, lo, hi = _median_ci(ratio)
    amed, alo, ahi = _median_ci(aa, seed=1)
    word = _verdict_word(lo, hi, alo, ahi, target)
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
    per = {k: 1e3 * float(v) / hits for k, v in br.items() if not k.startswith("async_")}
    print(
        f"  worker load per connector hit (mean of {hits}): total "
        f"{1e3 * float(w.get('load_seconds', 0.0)) / hits:.1f} ms = "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in per.items())
        + f" ({w.get('sync_loaded_chunks', 0)} chunks loaded in all)"
    )


def _versions(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """``(label, PYTHONPATH)`` of each code version to run: this tree, then each ``--ref``."""
    return [("this tree", None)] + [
        (f"--ref {ref}", str(Path(ref).resolve())) for ref in args.ref or ()
    ]


def _hit_ratios(rows: dict[str, Any]) -> tuple[list[float], list[float], list[float]]:
    """Per pair of a hit run's ``(TTFT, cached tokens)`` rows: connector / vLLM hit, the
    A/A (vLLM's twin / vLLM hit), and connector / the geometric mean of both of the pair's
    vLLM hits (vLLM's own hit measured twice per pair: less of one measurement's noise in
    the baseline)."""
    ratios = [c[0] / v[0] for c, v in zip(rows["connector"], rows["vllm"], strict=True)]
    aa = [a[0] / v[0] for a, v in zip(rows["vllm_aa"], rows["vllm"], strict=True)]
    both = [
        c[0] / (v[0] * a[0]) ** 0.5
        for c, v, a in zip(rows["connector"], rows["vllm"], rows["vllm_aa"], strict=True)
    ]
    return ratios, aa, both


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
        "in_process": args.hit_in_process,
    }
    if args.ref:
        _scenario_hit_versions(args, spec, tmp)
        return
    rows = _run_child("hit", spec, tmp, in_process=args.hit_in_process)
    hooks = rows.pop("hooks", None)
    by_hook = rows.pop("by_hook", None)
    ratios, aa, both = _hit_ratios(rows)
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
    print(f"  connector / geometric mean of the pair's two vLLM hits: {_verdict(both, aa, 1.2)}")
    _print_load_breakdown(tmp / "stats-hit", len(rows["connector"]))
    if hooks:
        print(
            "  connector hooks on the engine thread per measurement (median): "
            + ", ".join(f"{k} {statistics.median(v) * 1e3:.2f} ms" for k, v in hooks.items() if v)
        )
    if by_hook:
        names = sorted({n for arm in by_hook.values() for d in arm for n in d})
        for n in names:
            per = {
                k: statistics.median(d.get(n, 0.0) for d in v) * 1e3
                for k, v in by_hook.items()
                if v and k != "cold"
            }
            if max(per.values(), default=0.0) >= 0.01:
                print(f"    {n:<28} " + ", ".join(f"{k} {x:.2f} ms" for k, x in per.items()))
    print(f"  cold / connector: {med['cold'] / med['connector']:.1f}x")


def _scenario_hit_versions(args: argparse.Namespace, spec: dict[str, Any], tmp: Path) -> None:
    """``--scenario hit --ref DIR ...``: one engine process per version (this tree and
    each ``--ref``) alive together; per prompt and pair, each engine measures one pair
    (vLLM hit, A/A twin, connector hit), the versions in random order. Each version's
    connector / vLLM ratio as in the single-engine run, and each ``--ref`` against this
    tree: per pair round, this tree's ratio / the ref's ratio (pass a copy of this tree
    as a ``--ref`` for an A/A between engines)."""
    versions = _versions(args)
    servers = []
    for v, (_label, pythonpath) in enumerate(versions):
        s = {
            **spec,
            "ktc": _ktc(spec["ktc"]["kv_connector_extra_config"]["config"], tmp / f"stats-hit-{v}"),
        }
        servers.append(
            _Server(
                f"hit-{v}",
                s,
                tmp,
                pythonpath,
                kind="hitserve",
                in_process=args.hit_in_process,
                kv_space=_env(False).get("VLLM_CPU_KVCACHE_SPACE", "4"),
            )
        )
    for (label, _), srv in zip(versions, servers, strict=True):
        print(f"  {label}: lmcache_core from {srv.request('where')['lmcache_core']}")
    rng = random.Random(11)
    rows: list[dict[str, list[Any]]] = [
        {"cold": [], "vllm": [], "vllm_aa": [], "connector": []} for _ in versions
    ]
    t0 = time.monotonic()
    try:
        for i in range(args.prompts):
            for v, srv in enumerate(servers):
                rows[v]["cold"].append(srv.request(f"prep {i}")["cold"])
            for _ in range(args.pairs):
                order = list(range(len(servers)))
                rng.shuffle(order)
                seed = rng.randrange(1 << 30)
                for v in order:
                    res = servers[v].request(f"pair {i} {seed}")
                    for k, x in res.items():
                        rows[v][k].append(x)
    finally:
        for srv in servers:
            srv.close()
    print(
        f"hit: {args.prompts} prompts x {args.tokens} tokens, {args.pairs} interleaved pairs "
        f"each, {args.tier} tier, {len(versions)} engine processes alive together, versions "
        f"interleaved per pair ({time.monotonic() - t0:.0f} s)"
    )
    ratios = []
    for v, ((label, _), r) in enumerate(zip(versions, rows, strict=True)):
        rat, aa, both = _hit_ratios(r)
        ratios.append(both)
        med = {k: statistics.median(t for t, _ in xs) for k, xs in r.items()}
        cached = sorted({c for _, c in r["connector"]})
        print(
            f"  {label}: TTFT medians cold {med['cold'] * 1e3:.1f} ms, vLLM hit "
            f"{med['vllm'] * 1e3:.1f} ms, A/A twin {med['vllm_aa'] * 1e3:.1f} ms, connector hit "
            f"{med['connector'] * 1e3:.1f} ms (cached tokens {cached})"
        )
        print(f"    connector / vLLM hit, per pair: {_verdict(rat, aa, 1.2)}")
        print(
            f"    connector / geometric mean of the pair's two vLLM hits: {_verdict(both, aa, 1.2)}"
        )
        _print_load_breakdown(tmp / f"stats-hit-{v}", len(r["connector"]))
    for (label, _), both in zip(versions[1:], ratios[1:], strict=True):
        paired = [a / b for a, b in zip(ratios[0], both, strict=True)]
        print(
            f"  this tree / {label}, per pair round (connector / both vLLM hits, each in its "
            f"own engine): {_ci_text(paired, seed=3)}"
        )


def scenario_disk(args: argparse.Namespace, base: dict[str, Any], tmp: Path) -> None:
    versions = _versions(args)
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in versions}
    # Engine processes of each version alternate (--disk-runs each), each on its own tier.
    for run in range(args.disk_runs):
        for v, (label, pythonpath) in enumerate(versions):
            disk = tmp / f"kv-disk-{run}-{v}"
            tiers: list[dict[str, Any]] = [
                {"name": "disk", "backend": "disk", "options": {"path": str(disk)}}
            ]
            if args.disk_tiers == "cpu+disk":
                cpu = {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "2GiB"}}
                tiers = [cpu, {**tiers[0], "write": {"policy": "through"}}]
            stats = tmp / f"stats-disk-{run}-{v}"
            spec = {
                **base,
                # (this scenario measures loads: a lookup slowed by a busy machine must not miss)
                "ktc": _ktc(
                    {"chunk_size": args.chunk_size, "tiers": tiers}, stats, lookup_deadline_ms=2000
                ),
                "prefix_caching": True,
                "tokens": args.disk_chunks * args.chunk_size + 1,
                "reps": args.disk_reps,
                "in_process": args.disk_in_process,
                "disk": str(disk),
                "stats_dir": str(stats),
                # a cpu tier above: every repetition clears it (reset_cache), so the load
                # comes from disk and is promoted into it, as in a fresh process
                "reset_connector": args.disk_tiers == "cpu+disk",
            }
            results[label].append(
                _run_child(
                    "disk",
                    spec,
                    tmp,
                    in_process=args.disk_in_process,
                    pythonpath=pythonpath,
                    tag=f"-{run}-{v}",
                )
            )
    mode = "in-process engine" if args.disk_in_process else "worker in its own process"
    first = results[versions[0][0]][0]
    print(
        f"disk: one request loading {first['chunks']} chunks of "
        f"{first['chunk_bytes'] / 2**20:.1f} MiB from a {args.disk_tiers} hierarchy, page cache "
        f"dropped, {args.disk_reps} interleaved repetitions per engine, {args.disk_runs} "
        f"engine run(s) per version ({mode})"
    )
    for label, runs in results.items():
        rows: dict[str, list[float]] = {}
        for r in runs:
            for k in ("worker", "worker_reads", "backend", "single", "aligned"):
                rows.setdefault(k, []).extend(r.get(k, []))
        w = statistics.median(rows["worker"]) / 1e9
        b = statistics.median(rows["backend"]) / 1e9
        ratios = [x / y for x, y in zip(rows["worker"], rows["backend"], strict=True)]
        reads = statistics.median(rows["worker_reads"]) / 1e9
        single = statistics.median(rows["single"]) / 1e9
        med, lo, hi = _median_ci(ratios)
        print(f"  {label}:")
        print(f"    worker, first read -> get_finished:  {w:.2f} GB/s (median)")
        print(f"    worker, first read -> last chunk in: {reads:.2f} GB/s (median)")
        print(f"    disk backend, one batched_get_into:  {b:.2f} GB/s (median)")
        print(f"    disk backend, one get_into per chunk, all at once: {single:.2f} GB/s (median)")
        if rows["aligned"]:
            al = [x / y for x, y in zip(rows["worker"], rows["aligned"], strict=True)]
            print(
                f"    disk backend, one batched_get_into into page-aligned buffers: "
                f"{statistics.median(rows['aligned']) / 1e9:.2f} GB/s (median); worker / it "
                f"{statistics.median(al):.2f}x"
            )
        print(
            f"    worker / backend batched, per repetition: median {med:.2f}x, 95% CI "
            f"{lo:.2f}-{hi:.2f}x ({_spread(ratios)}); target >= 0.7x: "
            + ("met" if lo >= 0.7 else "not met" if hi < 0.7 else "within noise")
        )
        spans = [sp for r in runs for sp in r.get("spans", [])]
        if spans:
            keys = sorted({k for sp in spans for k in sp if k != "bytes"})
            print(
                "    worker's spans per load (ms, median; summed over chunks but lookup, "
                "issue, last, report): "
                + ", ".join(
                    f"{k} {statistics.median(sp.get(k, 0.0) for sp in spans):.1f}" for k in keys
                )
            )
        cpus = [c for r in runs for c in r.get("thread_cpu", [])]
        steps = [n for r in runs for n in r.get("steps", [])]
        if steps:
            print(
                f"    engine steps from the load's start to its report: {statistics.median(steps)} (median)"
            )
        if cpus:
            names = sorted({k for c in cpus for k in c})
            per = {k: statistics.median(c.get(k, 0.0) for c in cpus) * 1e3 for k in names}
            print(
                "    CPU per thread from the load's start to its report (ms, median): "
                + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1]))
            )
        per_run = [
            statistics.median(x / y for x, y in zip(r["worker"], r["backend"], strict=True))
            for r in runs
        ]
        print("    per engine run: " + ", ".join(f"{x:.2f}x" for x in per_run))


def scenario_itl(args: argparse.Namespace, base: dict[str, Any], tmp: Path) -> None:
    disk = tmp / "kv-itl"
    tiers: list[dict[str, Any]] = [
        {"name": "disk", "backend": "disk", "options": {"path": str(disk)}}
    ]
    if args.itl_no_promote:
        tiers[0]["promote"] = False
    if args.itl_tiers == "cpu+disk":
        cpu = {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "2GiB"}}
        tiers = [cpu, {**tiers[0], "write": {"policy": "through"}}]
    spec = {
        **base,
        # (no statistics file, as by default; a lookup slowed by the busy machine must
        # not turn the hit into a miss)
        "ktc": _ktc({"chunk_size": args.chunk_size, "tiers": tiers}, None, lookup_deadline_ms=2000),
        "prefix_caching": True,
        "tokens": args.disk_chunks * args.chunk_size + 1,
        "chunk_size": args.chunk_size,
        "rounds": args.itl_rounds,
        "decode_tokens": args.itl_start_after + args.itl_window + 2,
        "start_after": args.itl_start_after,
        "window": args.itl_window,
        "disk": str(disk),
        "tiers": args.itl_tiers,
        # (the cpu tier's hit: its chunks are promoted there by a load from disk)
        "memhit": args.itl_tiers == "cpu+disk" and not args.itl_no_promote,
    }
    res = _run_child("itl", spec, tmp, in_process=True)
    rows: dict[str, list[dict[str, Any]]] = res["rows"]
    print(
        f"itl ({args.itl_tiers} tiers{', no promotion' if args.itl_no_promote else ''}): a decoding request's inter-token latency over the "
        f"{args.itl_window} tokens after another request of {spec['tokens']} tokens arrives "
        f"({args.disk_chunks} chunks; 'hit': on disk only, page cache dropped; 'memhit': in "
        f"the cpu tier; 'cold': a unique prompt of that length, prefilled and saved), "
        f"{args.itl_rounds} rounds, arms in random order (in-process engine)"
    )
    others: list[str] = [a for a in ("hit", "memhit", "cold") if a in rows]
    for arm in others:
        sync = statistics.median(r["sync_chunks"] for r in rows[arm])
        bg = statistics.median(r["async_chunks"] for r in rows[arm])
        print(f"  {arm}: chunks loaded before the forward pass {sync}, in the background {bg}")

    def stat(arm: str, f: Any) -> list[float]:
        return [f(r["itl"]) for r in rows[arm]]

    for what, f in (
        ("mean", statistics.fmean),
        ("median", statistics.median),
        ("max", max),
    ):
        per = {a: stat(a, f) for a in rows}
        print(
            f"  {what} ITL (ms, median of rounds): "
            + ", ".join(f"{a} {statistics.median(v) * 1e3:.1f}" for a, v in per.items())
        )
        for arm in [*others, "base2"]:
            ratio = [x / y for x, y in zip(per[arm], per["base"], strict=True)]
            print(f"    {arm} / base: {_ci_text(ratio)} (per round {_spread(ratio)})")
    for arm in others:
        tt = [r["ttft"] for r in rows[arm]]
        print(
            f"  the arriving request's TTFT, {arm}: {statistics.median(tt) * 1e3:.0f} ms (median)"
        )
    for arm in ("base", *[a for a in others if a != "cold"]):
        n = min(len(r["hooks"]) for r in rows[arm])
        names = sorted({k for r in rows[arm] for h in r["hooks"] for k in h})
        hook_ms = [
            {
                k: statistics.median(r["hooks"][i].get(k, 0.0) for r in rows[arm]) * 1e3
                for k in names
            }
            for i in range(n)
        ]
        print(
            f"  {arm}: the connector's hooks in the first {n} gaps (ms, median of rounds): "
            + "; ".join(
                f"{i}: "
                + (
                    ", ".join(
                        f"{k} {v:.1f}"
                        for k, v in sorted(h.items(), key=lambda kv: -kv[1])
                        if v >= 0.1
                    )
                    or "-"
                )
                for i, h in enumerate(hook_ms)
            )
        )
    for arm in ("base", *[a for a in others if a != "cold"]):
        n = min(len(r["itl"]) for r in rows[arm])
        line = [statistics.median(r["itl"][i] for r in rows[arm]) * 1e3 for i in range(n)]
        print(
            f"  {arm}: gap after each token from the arrival on (ms, median of rounds): "
            + " ".join(f"{x:.1f}" for x in line)
        )


class _Server:
    """A child engine process taking miss measurements on request (see _child_serve)."""

    def __init__(
        self,
        name: str,
        spec: dict[str, Any],
        tmp: Path,
        pythonpath: str | None = None,
        kind: str = "serve",
        in_process: bool = True,
        kv_space: str = "2",
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
                kind,
                "--spec",
                str(spec_path),
                "--out",
                self.out,
            ],
            env={
                **_env(in_process),
                "VLLM_CPU_KVCACHE_SPACE": kv_space,
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
        first, saved = self.request(f"{what} {seed}")
        return float(first), float(saved)

    def request(self, line: str) -> Any:
        """Send one request line; its result (JSON)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        self._wait(f"DONE {self.n}")
        res = json.loads(Path(f"{self.out}.{self.n}.json").read_text())
        self.n += 1
        return res

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        self.log.close()


def _miss_storage(args: argparse.Namespace, tmp: Path, name: str) -> dict[str, Any]:
    tiers: list[dict[str, Any]] = [
        {"name": "cpu", "backend": "cpu", "options": {"max_bytes": args.miss_cpu_bytes}}
    ]
    if args.miss_tiers == "cpu+disk":
        disk: dict[str, Any] = {"path": str(tmp / name)}
        if args.miss_nice is not None:
            disk["io_nice"] = args.miss_nice
        tiers.append({"name": "disk", "backend": "disk", "options": disk})
    return {"chunk_size": args.chunk_size, "tiers": tiers}


def scenario_miss(args: argparse.Namespace, base: dict[str, Any], tmp: Path) -> None:
    if args.miss_design == "engines":
        scenario_miss_engines(args, base, tmp)
        return
    n = args.miss_processes
    results: list[dict[str, Any]] = []
    for i in range(n):
        name = "kv-miss" if n == 1 else f"kv-miss-p{i}"
        spec = {
            **base,
            # (the toggle reads the worker's counters in-process: no statistics file, as
            # the connector runs by default, unless --miss-stats-file)
            "ktc": _ktc(
                _miss_storage(args, tmp, name),
                tmp / f"stats-{name}" if args.miss_stats_file else None,
                **({} if args.miss_nice is None else {"copy_nice": args.miss_nice}),
            ),
            "nice": args.miss_nice,
            "tokens": args.miss_tokens,
            "batch_tokens": args.batch_tokens,
            "reps": args.miss_reps,
            "min_reps": args.miss_min_reps,
            "budget_s": args.miss_budget_s,
            "ttft_per_round": args.miss_ttft_per_round,
            "on0": args.miss_on0,
            "idle_arm": args.miss_idle_arm,
            "split_arms": args.miss_split_arms,
            "unbatched_arm": args.miss_unbatched_arm,
            "warm_batches": args.miss_warm_batches,
            "sys_split": args.miss_sys_split,
            "nosync_arm": args.miss_nosync_arm,
            "cpuonly_arm": args.miss_cpuonly_arm,
            "nowait_arm": args.miss_nowait_arm,
        }
        res = _run_child("toggle", spec, tmp, in_process=True, tag="" if n == 1 else f"-p{i}")
        shutil.rmtree(tmp / name, ignore_errors=True)  # GBs of write-through per process
        if n > 1:
            print(f"== engine process {i + 1} of {n} ==")
        _print_toggle(args, res)
        results.append(res)
        sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(results[0] if n == 1 else results))
    if n > 1:
        _print_across_processes(results, 1.05)


# Two-sided 95% quantiles of Student's t by degrees of freedom; between and beyond the
# rows, the row below is used (fewer degrees of freedom: a slightly wider interval).
_T975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
    9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
    17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042,
}  # fmt: skip


def _t975(df: int) -> float:
    return _T975[max(k for k in _T975 if k <= max(df, 1))]


def _mean_ci_log(xs: list[float]) -> tuple[float, float, float]:
    """Geometric mean of the ratios ``xs`` and its 95% Student-t interval (on logs): the
    interval of the mean over independent units (engine processes), which is valid however
    much the units differ from each other; needs two or more."""
    logs = [math.log(x) for x in xs]
    m = statistics.fmean(logs)
    half = _t975(len(xs) - 1) * statistics.stdev(logs) / math.sqrt(len(xs))
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def _toggle_ratios(
    rows: dict[str, list[dict[str, Any]]],
) -> tuple[list[float], list[float], list[float]]:
    """Per round of one toggle run's ``ttft`` or ``batch`` rows: the baseline
    ``sqrt(off * off2)``, ``on`` over it, and the A/A ``off2 / off``."""
    on = [m["first"] for m in rows["on"]]
    off = [m["first"] for m in rows["off"]]
    off2 = [m["first"] for m in rows["off2"]]
    base_ = [(a * b) ** 0.5 for a, b in zip(off, off2, strict=True)]
    return (
        base_,
        [c / b for c, b in zip(on, base_, strict=True)],
        [b / a for a, b in zip(off, off2, strict=True)],
    )


def _print_across_processes(results: list[dict[str, Any]], target: float) -> None:
    """The miss bars over engine processes. The ratio of unchanged code moves from one
    engine process to the next by more than one run's interval (docs/performance.md), so
    one process's bootstrap interval understates the uncertainty; here each process is one
    sample (the median of its rounds' ratios) and the interval is Student's t over them."""
    n = len(results)
    print(f"across {n} engine processes (each one sample: the median of its rounds' ratios;")
    print("  geometric mean with a 95% Student-t interval over processes):")
    for what in ("ttft", "batch"):
        meds, aas = [], []
        for res in results:
            _, ratios, aa = _toggle_ratios(res[what])
            meds.append(statistics.median(ratios))
            aas.append(statistics.median(aa))
        m, lo, hi = _mean_ci_log(meds)
        am, alo, ahi = _mean_ci_log(aas)
        word = _verdict_word(lo, hi, alo, ahi, target)
        print(
            f"  {what:<5} on / off per process: {', '.join(f'{x:.3f}' for x in meds)}x; "
            f"A/A per process: {', '.join(f'{x:.3f}' for x in aas)}x"
        )
        print(
            f"        on / off {m:.3f}x, 95% CI {lo:.3f}-{hi:.3f}x; A/A {am:.3f}x, 95% CI "
            f"{alo:.3f}-{ahi:.3f}x; target <= {target}x: {word}"
        )


def _print_toggle(args: argparse.Namespace, res: dict[str, Any]) -> None:
    """One toggle run's report (one engine process)."""
    print(
        f"miss ({args.miss_tiers} tiers), one in-process engine, the connector's work switched "
        f"on / off / off again (A/A) in random order per round ({res['rounds']} rounds; copy "
        f"threads at nice {res.get('copy_nice')}; {args.miss_warm_batches} warm-up batches; "
        "statistics files "
        f"{'on' if args.miss_stats_file else 'off'}): "
        f"TTFT of one unique {args.miss_tokens}-token prompt ({args.miss_ttft_per_round} "
        "sub-rounds per round), wall time of 20 unique "
        f"{args.batch_tokens}-token prompts (8 output tokens each). Saves included: each "
        "measurement ends once its saves are in every tier"
    )
    print(f"  code: {', '.join(res.get('code', []))}")
    st = res.get("stats") or {}
    print(
        f"  saves: {st.get('gathered_chunks')} chunks gathered, {st.get('gathered_into_tier')} "
        "of them into memory the cpu tier reserved (stored without further copies; the rest "
        "through staging buffers: the tier had no recycled memory yet)"
    )
    for what, unit, scale in (("ttft", "ms", 1e3), ("batch", "s", 1.0)):
        rows = res[what]
        on = [m["first"] for m in rows["on"]]
        off = [m["first"] for m in rows["off"]]
        off2 = [m["first"] for m in rows["off2"]]
        base_, ratios, aa = _toggle_ratios(rows)
        tail = [m["saved"] - m["first"] for m in rows["on"]]
        print(
            f"  {what:<5} medians: off {statistics.median(off) * scale:.1f} {unit}, off2 "
            f"{statistics.median(off2) * scale:.1f} {unit}, on {statistics.median(on) * scale:.1f} "
            f"{unit} (saves done {statistics.median(tail) * 1e3:.0f} ms after the outputs)"
        )
        print(f"    on / off, per round: {_verdict(ratios, aa, 1.05)}")

        def vs_off(xs: list[float], base_: list[float] = base_, aa: list[float] = aa) -> str:
            return _verdict([c / n for c, n in zip(xs, base_, strict=True)], aa, 1.05)

        def paired(a: list[float], b: list[float]) -> str:
            return _ci_text([x / y for x, y in zip(a, b, strict=True)], seed=4)

        if "on0" in rows:
            on0 = [m["first"] for m in rows["on0"]]
            print(
                f"    on0 (copy threads at vLLM's priority) median {statistics.median(on0) * scale:.1f} "
                f"{unit}; on0 / off, per round: {vs_off(on0)}"
            )
            print(f"    on / on0, paired: {paired(on, on0)}")
        if "onidle" in rows:
            oi = [m["first"] for m in rows["onidle"]]
            print(
                f"    onidle (background threads at SCHED_IDLE) median "
                f"{statistics.median(oi) * scale:.1f} {unit}; onidle / off, per round: "
                f"{vs_off(oi)}"
            )
            print(f"    onidle / on, paired: {paired(oi, on)}")
            sd = [m["saved"] - m["first"] for m in rows["onidle"]]
            print(f"    onidle: saves done {statistics.median(sd) * 1e3:.0f} ms after the outputs")
        for arm in [
            a for a in ("plan", "gather", "onub", "onnosync", "oncpu", "onnowait") if a in rows
        ]:
            xs = [m["first"] for m in rows[arm]]
            print(
                f"    {arm} median {statistics.median(xs) * scale:.1f} {unit}; {arm} / off, per "
                f"round: {vs_off(xs)}; on / {arm}, paired: {paired(on, xs)}"
            )
        durable = [m["saved"] / n for m, n in zip(rows["on"], base_, strict=True)]
        print(f"    on until its saves are in every tier / off: {_ci_text(durable, seed=2)}")
        # Where the connector's time goes, as fractions of the off arm's wall time.
        for arm in [
            a
            for a in (
                "on",
                "on0",
                "onidle",
                "plan",
                "gather",
                "onub",
                "onnosync",
                "oncpu",
                "onnowait",
                "off",
            )
            if a in rows
        ]:
            hooks = statistics.median(m["hooks"] for m in rows[arm])
            thr = statistics.median(m["threads_cpu"] for m in rows[arm])
            ref = statistics.median(off)
            print(
                f"    {arm:<4}: connector hooks on the engine thread {hooks * 1e3:.1f} ms "
                f"({100 * hooks / ref:.1f}%), other Python threads' CPU {thr * 1e3:.1f} ms "
                f"({100 * thr / ref:.1f}%) (medians, % of the off arm's median)"
            )
        # The 'on' arm's hook time per connector method (medians; the largest first).
        names = {n for m in rows["on"] for n in m.get("by_hook", {})}
        per = {
            n: statistics.median(m.get("by_hook", {}).get(n, 0.0) for m in rows["on"])
            for n in names
        }
        top = [
            f"{n} {v * 1e3:.1f}" for n, v in sorted(per.items(), key=lambda x: -x[1]) if v >= 5e-5
        ]
        if top:
            print(f"    on  : hooks by method, ms (medians): {', '.join(top)}")
        if what == "batch" and any("sys" in m for m in rows["on"]):
            _print_sys_split(rows)


def _print_sys_split(rows: dict[str, list[dict[str, Any]]]) -> None:
    """``--miss-sys-split``: per arm, medians per batch (t0 -> the outputs) of where the
    machine's core time went, and on - off of each (paired by round)."""
    keys = [f"cpu:{k}" for k in _STAT_FIELDS] + [
        "self",
        "kthread:jbd2",
        "kthread:kworker",
        "kthread:ksoftirqd",
        "kthread:other",
        "others",
        "rq:main",
        "rq:native",
        "rq:lmcache",
        "rq:python",
    ]
    arms = [a for a in rows if rows[a] and "sys" in rows[a][0]]
    print("    core time per batch (ms, medians; t0 -> outputs; /proc/stat is machine-wide):")
    print(f"      {'':<18}" + "".join(f"{a:>10}" for a in arms) + "   on-off (median of pairs)")
    for k in ["wall x cpus", *keys]:
        vals = []
        for a in arms:
            if k == "wall x cpus":
                xs = [m["sys_wall"] * (os.cpu_count() or 1) for m in rows[a]]
            else:
                xs = [m["sys"].get(k, 0.0) for m in rows[a]]
            vals.append(xs)
        meds = [statistics.median(x) * 1e3 for x in vals]
        diff = ""
        if "on" in arms and "off" in arms:
            xs_on, xs_off = vals[arms.index("on")], vals[arms.index("off")]
            diff = (
                f"{statistics.median(a - b for a, b in zip(xs_on, xs_off, strict=True)) * 1e3:+.0f}"
            )
        print(f"      {k:<18}" + "".join(f"{m:>10.0f}" for m in meds) + f"   {diff:>8}")


def scenario_miss_engines(args: argparse.Namespace, base: dict[str, Any], tmp: Path) -> None:
    storage = _miss_storage(args, tmp, "kv-miss")
    tiers = storage["tiers"]
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
        geo = [(a * b) ** 0.5 for a, b in zip(none, none2, strict=True)]
        conn = [x for x, _ in samples["connector"][what]]
        conn_saved = [y for _, y in samples["connector"][what]]
        ratios = [c / n for c, n in zip(conn, geo, strict=True)]
        aa = [c / n for c, n in zip(none2, none, strict=True)]
        durable = [c / n for c, n in zip(conn_saved, geo, strict=True)]
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
            rr = [c / n for c, n in zip(ref, geo, strict=True)]
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
    ap.add_argument("--scenario", choices=("all", "hit", "disk", "miss", "itl"), default="all")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2049)
    ap.add_argument("--pairs", type=int, default=25)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--tier", choices=("cpu", "disk"), default="cpu", help="hit scenario's tier")
    ap.add_argument(
        "--hit-in-process",
        action="store_true",
        help="hit: scheduler and worker in the driver process; also prints the connector's "
        "time on the engine thread per measurement",
    )
    ap.add_argument("--disk-chunks", type=int, default=16)
    ap.add_argument("--disk-reps", type=int, default=5)
    ap.add_argument(
        "--disk-runs", type=int, default=1, help="disk: engine processes per version, alternated"
    )
    ap.add_argument(
        "--disk-tiers",
        choices=("disk", "cpu+disk"),
        default="disk",
        help="disk: the connector's tiers (cpu+disk: loads promote into the cleared cpu tier)",
    )
    ap.add_argument(
        "--ref",
        metavar="DIR",
        action="append",
        help="disk and hit: also run the worker of another version (repeatable): "
        "PYTHONPATH=DIR for its engines (DIR/lmcache_core and DIR/lmcache_backend_disk, e.g. "
        "from git archive); hit: one engine per version alive together, pairs interleaved",
    )
    ap.add_argument(
        "--disk-in-process",
        action="store_true",
        help="disk scenario: scheduler and worker in the driver process",
    )
    ap.add_argument("--itl-rounds", type=int, default=9, help="itl: rounds (every arm once)")
    ap.add_argument(
        "--itl-start-after",
        type=int,
        default=10,
        help="itl: decoded tokens before the other request arrives",
    )
    ap.add_argument(
        "--itl-window", type=int, default=40, help="itl: inter-token latencies measured"
    )
    ap.add_argument(
        "--itl-tiers",
        choices=("disk", "cpu+disk"),
        default="cpu+disk",
        help="itl: the connector's tiers (cpu+disk adds the arm 'memhit': a cpu-tier hit)",
    )
    ap.add_argument(
        "--itl-no-promote",
        action="store_true",
        help="itl: the disk tier's hits are not promoted into the cpu tier (no 'memhit')",
    )
    ap.add_argument("--miss-tokens", type=int, default=1025)
    ap.add_argument("--batch-tokens", type=int, default=513)
    ap.add_argument("--miss-tiers", choices=("cpu", "cpu+disk"), default="cpu+disk")
    ap.add_argument(
        "--miss-design",
        choices=("toggle", "engines"),
        default="toggle",
        help="miss: 'toggle' switches the connector's work on and off in one in-process "
        "engine (no process effect); 'engines' compares engine processes with and without it",
    )
    ap.add_argument("--miss-cpu-bytes", default="2GiB", help="miss: the cpu tier's max_bytes")
    ap.add_argument(
        "--miss-ref",
        metavar="DIR",
        help="miss: also measure the connector of another lmcache_core version, imported "
        "from DIR/lmcache_core (e.g. git archive COMMIT lmcache_core | tar -x -C DIR)",
    )
    ap.add_argument(
        "--miss-ttft-per-round",
        type=int,
        default=3,
        help="miss (toggle): TTFT sub-rounds per round (each: every arm once, random order)",
    )
    ap.add_argument(
        "--miss-warm-batches",
        type=int,
        default=0,
        help="miss (toggle): unrecorded 20-prompt batches with the connector on before the "
        "rounds (about 13 fill a 2 GiB cpu tier: steady state, evicted buffers recycled)",
    )
    ap.add_argument(
        "--miss-nice",
        type=int,
        default=None,
        help="miss (toggle): the connector's copy threads (copy_nice) and the disk tier's "
        "pool threads (io_nice) this much nicer than vLLM (default: the defaults, 0); with "
        "--miss-on0 the arm 'on0' runs both at vLLM's priority",
    )
    ap.add_argument(
        "--miss-nowait-arm",
        action="store_true",
        help="miss (toggle): arm 'onnowait': the connector on with its scheduler's first poll "
        "of a running shared-tier lookup not waiting for it (first_wait_s 0)",
    )
    ap.add_argument(
        "--miss-on0",
        action="store_true",
        help="miss (toggle): also the arm 'on0', the connector on with its copy threads at "
        "vLLM's priority (when copy_nice lowers them)",
    )
    ap.add_argument(
        "--miss-split-arms",
        action="store_true",
        help="miss (toggle): also the arms 'plan' (connector on, the worker gathers and "
        "stores nothing) and 'gather' (it gathers into one reused buffer, stores nothing)",
    )
    ap.add_argument(
        "--miss-sys-split",
        action="store_true",
        help="miss (toggle): per batch, where the machine's core time went (/proc/stat: "
        "user, system, idle, iowait, softirq; this process, kernel threads by kind "
        "(jbd2, kworker, ksoftirqd), other processes), printed per arm",
    )
    ap.add_argument(
        "--miss-nosync-arm",
        action="store_true",
        help="miss (toggle): arm 'onnosync': the connector on with the disk tier's flushes "
        "off (fsync: false), paired with 'on' in the same process",
    )
    ap.add_argument(
        "--miss-cpuonly-arm",
        action="store_true",
        help="miss (toggle): arm 'oncpu': the connector on with no write-through to its "
        "lower tiers (their write policy 'none'), paired with 'on' in the same process",
    )
    ap.add_argument(
        "--miss-unbatched-arm",
        action="store_true",
        help="miss (toggle): also the arm 'onub', the connector on with the lower tiers' "
        "background stores one put per chunk (max_batch 1: no batched write-through)",
    )
    ap.add_argument(
        "--miss-idle-arm",
        action="store_true",
        help="miss (toggle): also the arm 'onidle', the connector on with its background "
        "threads (all but the IO loop) at SCHED_IDLE",
    )
    ap.add_argument(
        "--miss-stats-file",
        action="store_true",
        help="miss (toggle): also write the connector's statistics files (stats_dir), as "
        "runs before 2026-12-01 15:45 did; off by default, as in the connector",
    )
    ap.add_argument("--json", metavar="FILE", help="miss: write every sample to FILE")
    ap.add_argument("--miss-reps", type=int, default=30, help="miss: most rounds")
    ap.add_argument(
        "--miss-processes",
        type=int,
        default=1,
        help="miss (toggle design): run the toggle in this many fresh engine processes, "
        "one after another (--miss-budget-s and the rounds apply to each), and give the "
        "bars over processes: each process one sample, a Student-t interval over them",
    )
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
    if args.miss_processes < 1:
        ap.error("--miss-processes must be 1 or more")
    if args.miss_processes > 1 and args.miss_design == "engines":
        ap.error("--miss-processes applies to the toggle design only")
    if args.child:
        spec = json.loads(Path(args.spec).read_text())
        if args.child in ("serve", "hitserve"):
            (_child_serve if args.child == "serve" else _child_hitserve)(spec, args.out)
            return 0
        fn = {
            "hit": _child_hit,
            "disk": _child_disk,
            "toggle": _child_toggle,
            "itl": _child_itl,
        }[args.child]
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
        for name, run_scenario in (
            ("hit", scenario_hit),
            ("disk", scenario_disk),
            ("miss", scenario_miss),
            ("itl", scenario_itl),
        ):
            if args.scenario in ("all", name):
                t0 = time.monotonic()
                run_scenario(args, base, tmp)
                print(f"  ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
