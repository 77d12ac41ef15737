"""Drive one real vLLM engine through a list of steps; started by the tests in a subprocess.

Usage: ``python engine_driver.py SPEC.json OUT.json``. The spec gives the environment,
the ``LLM(...)`` arguments and the steps; the output records, per step, the generated
tokens, their logprobs, ``num_cached_tokens`` and the connector statistics files.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

# the disk tier's object paths, layout 2 (``ns2-…/ab/<name>``) and layout 1 (``ns-…/ab/cd/<name>``)
_OBJECT = re.compile(
    r"ns2-[0-9a-f]{16}/[0-9a-f]{2}/[0-9a-f]{32}|ns-[0-9a-f]{16}/[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{32}"
)


def disk_objects(root: str) -> list[str]:
    """Relative paths of the chunk objects under a disk tier's root."""
    base = Path(root)
    if not base.exists():
        return []
    out = []
    for p in base.rglob("*"):
        rel = p.relative_to(base).as_posix()
        if p.is_file() and _OBJECT.fullmatch(rel):
            out.append(rel)
    return sorted(out)


def wait_disk_stable(
    root: str, at_least: int = 0, quiet_s: float = 0.6, timeout_s: float = 20.0
) -> list[str]:
    """Wait until the disk tier holds ``at_least`` objects and background writes have
    settled; return its objects."""
    deadline = time.monotonic() + timeout_s
    last = disk_objects(root)
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = disk_objects(root)
        if now != last:
            last, since = now, time.monotonic()
        elif len(now) >= at_least and time.monotonic() - since >= quiet_s:
            break
    return last


def _saved_chunks(stats: list[dict[str, Any]]) -> int:
    """Chunks the workers writing the shared tiers saved (replica ranks write none)."""
    return sum(
        int(d.get("saved_chunks", 0))
        for d in stats
        if d.get("role") == "worker" and d.get("writes_shared_tiers", True)
    )


def _stats(stats_dir: str | None) -> list[dict[str, Any]]:
    if not stats_dir:
        return []
    from lmcache_core.integrations.vllm.stats_file import read_stats

    return read_stats(stats_dir)


def _result(out: Any) -> dict[str, Any]:
    comp = out.outputs[0]
    logprobs = []
    for tok, lp in zip(comp.token_ids, comp.logprobs or [], strict=False):
        logprobs.append(float(lp[tok].logprob))
    return {
        "request_id": out.request_id,
        "prompt": list(out.prompt_token_ids or []),
        "tokens": list(comp.token_ids),
        "logprobs": logprobs,
        "num_cached_tokens": out.num_cached_tokens,
        "finish_reason": comp.finish_reason,
    }


def _tokens(p: dict[str, Any], results: dict[str, Any]) -> list[int]:
    """A prompt's tokens: given, or an earlier output's prompt + generated tokens + more
    (a next turn built at the token level)."""
    if "from_step" in p:
        out = results["steps"][p["from_step"]]["outputs"][int(p.get("index", 0))]
        return [*out["prompt"], *out["tokens"], *p.get("append", [])]
    return list(p["tokens"])


def _prompt(p: dict[str, Any], results: dict[str, Any] | None = None) -> Any:
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=_tokens(p, results or {}))
    if p.get("cache_salt"):
        prompt["cache_salt"] = p["cache_salt"]
    return prompt


def _lora(p: dict[str, Any]) -> Any:
    """The prompt's LoRA adapter (``{"lora": {"name", "id", "path"}}``), or ``None``."""
    spec = p.get("lora")
    if not spec:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(spec["name"], int(spec["id"]), spec["path"])


def _abort(llm: Any, step: dict[str, Any], sp: Any) -> dict[str, Any]:
    """Add a request, run ``steps_before_abort`` engine steps, abort it, drain the engine."""
    engine = llm.llm_engine
    req_id = f"abort-{step['name']}"
    engine.add_request(req_id, _prompt(step["prompt"]), sp)
    outputs = []
    for _ in range(int(step["steps_before_abort"])):
        outputs.extend(engine.step())
    engine.abort_request([req_id])
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        outputs.extend(engine.step())
    finished = [o.request_id for o in outputs if getattr(o, "finished", False)]
    return {
        "finished_before_abort": req_id in finished,
        "unfinished": engine.has_unfinished_requests(),
    }


def _scheduler(llm: Any) -> Any:
    """vLLM's scheduler (in-process engine core only)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def _namespace(stats_dir: str) -> Any:
    from lmcache_core.keys import Namespace

    (doc,) = [d for d in _stats(stats_dir) if d.get("role") == "scheduler"]
    return Namespace.from_json(json.dumps(doc["namespace"]))


def chunk_keys(stats_dir: str, tokens: list[int], rank: int = 0, world_size: int = 1) -> list[Any]:
    """The keys the connector gives ``tokens``' chunks on ``rank`` (no salt, no extras)."""
    from lmcache_core.token_db import ChunkedTokenDatabase

    ns = _namespace(stats_dir)
    db = ChunkedTokenDatabase(
        namespace=ns, world_size=world_size, worker_id=rank, dtype=ns.kv_dtype
    )
    return db.keys(tokens)


_REMOVE = """
import json, sys
from lmcache_backend_disk.backend import DiskBackend
from lmcache_core import SyncBackend
from lmcache_core.keys import CacheEngineKey, Namespace
path, ns, keys = sys.argv[1], Namespace.from_json(sys.argv[2]), json.loads(sys.argv[3])
with SyncBackend(DiskBackend({"path": path}, namespace=ns)) as b:
    print(sum(b.remove(CacheEngineKey.from_string(k)) for k in keys))
"""


def remove_in_other_process(disk_dir: str, stats_dir: str, keys: list[Any]) -> int:
    """Remove chunks from the disk tier from another process (as another instance
    evicting them would); returns how many were there."""
    import subprocess

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _REMOVE,
            disk_dir,
            _namespace(stats_dir).to_json(),
            json.dumps([str(k) for k in keys]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return int(out.stdout.strip().splitlines()[-1])


_FILL = """
import json, sys, torch
from lmcache_backend_disk.backend import DiskBackend
from lmcache_core import SyncBackend
from lmcache_core.keys import Namespace
from lmcache_core.token_db import ChunkedTokenDatabase
path, ns, n, shape, max_bytes = sys.argv[1], Namespace.from_json(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
db = ChunkedTokenDatabase(namespace=ns, dtype=ns.kv_dtype)
with SyncBackend(DiskBackend({"path": path, "max_bytes": max_bytes}, namespace=ns)) as b:
    for i in range(n):
        b.put(db.make_key(0xF111 + i), torch.full(shape, float(i)))
    print(b.stats()["evictions"])
"""


def fill_in_other_process(
    disk_dir: str, stats_dir: str, n: int, shape: list[int], max_bytes: int
) -> int:
    """Store ``n`` filler chunks into the disk tier from another process, making it evict
    (as another instance sharing the tier would); returns how many entries it evicted."""
    import subprocess

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _FILL,
            disk_dir,
            _namespace(stats_dir).to_json(),
            str(n),
            json.dumps(shape),
            str(max_bytes),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return int(out.stdout.strip().splitlines()[-1])


def _write_control(step: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    from kv_test_backends import write_control

    values = dict(step.get("values", {}))
    fail = step.get("fail")
    if fail and "rank" in fail:  # one rank's copies only
        keys = chunk_keys(spec["stats_dir"], fail["tokens"], fail["rank"], fail["world_size"])
        values["fail_keys"] = [str(keys[c]) for c in fail["chunks"]]
    elif fail:
        keys = chunk_keys(spec["stats_dir"], fail["tokens"])
        values["fail"] = [keys[c].chunk_hash_hex for c in fail["chunks"]]
    write_control(spec["control_file"], **values)
    return values


def _wait_for_kv(llm: Any, req_id: str, max_steps: int = 2000) -> list[Any]:
    """Step until ``req_id`` waits for a background load; return the outputs seen."""
    from vllm.v1.request import RequestStatus

    engine, outputs = llm.llm_engine, []
    for _ in range(max_steps):
        outputs.extend(engine.step())
        req = _scheduler(llm).requests.get(req_id)
        if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return outputs
        time.sleep(0.001)
    raise RuntimeError(f"{req_id} never waited for its KV")


def _finish(llm: Any, outputs: list[Any], timeout_s: float = 60.0) -> list[Any]:
    """Step until no request is left, including finished ones whose blocks wait for
    the connector (as vLLM's engine-core loop does)."""
    engine, sched = llm.llm_engine, _scheduler(llm)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not engine.has_unfinished_requests() and not sched.has_requests():
            return outputs
        outputs.extend(engine.step())
        time.sleep(0.001)
    raise RuntimeError("requests did not finish")


def _last(outputs: list[Any], req_id: str) -> dict[str, Any]:
    mine = [o for o in outputs if o.request_id == req_id and o.finished]
    return _result(mine[-1])


def _while_waiting(llm: Any, step: dict[str, Any], sp: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """A request that loads in the background; while it waits for its KV, either abort
    it or have another process fill the disk tier (evicting what it can)."""
    engine = llm.llm_engine
    req_id = f"{step['op']}-{step['name']}"
    free = _scheduler(llm).kv_cache_manager.block_pool.get_num_free_blocks
    before = free()
    internal_id = engine.add_request(req_id, _prompt(step["prompt"]), sp)
    outputs = _wait_for_kv(llm, internal_id)  # the scheduler knows it by its internal id
    rec: dict[str, Any] = {}
    if step["op"] == "abort_waiting":
        engine.abort_request([req_id])
        _finish(llm, outputs)
        rec["unfinished"] = engine.has_unfinished_requests()
        rec["free_blocks_before"], rec["free_blocks_after"] = before, free()
        return rec
    rec["evicted"] = fill_in_other_process(
        spec["disk_dir"], spec["stats_dir"], step["fill_chunks"], step["shape"], step["max_bytes"]
    )
    _finish(llm, outputs)
    rec["outputs"] = [_last(outputs, req_id)]
    return rec


def _itl(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    """Inter-token latencies of one decoding request, alone or while ``concurrent``
    requests (added once it has produced ``start_after`` tokens) run."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    n = int(step["decode_tokens"])
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    sp_other = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True)
    dec = f"dec-{step['name']}"
    engine.add_request(dec, _prompt(step["decode"]), sp)
    stamps: list[float] = []
    seen = 0
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    outputs: list[Any] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        outputs.extend(outs)
        for o in outs:
            if o.request_id == dec and len(o.outputs[0].token_ids) > seen:
                seen = len(o.outputs[0].token_ids)
                stamps.append(now)
            elif o.request_id in added and o.request_id not in first and o.outputs[0].token_ids:
                first[o.request_id] = now
        if seen >= int(step.get("start_after", 20)) and not added:
            for i, p in enumerate(step.get("concurrent", [])):
                rid = f"slow-{step['name']}-{i}"
                engine.add_request(rid, _prompt(p), sp_other)
                added[rid] = time.perf_counter()
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return {
        "itl": itl,
        "tokens": seen,
        "outputs": [_last(outputs, rid) for rid in added],
        "ttft": [first.get(rid, float("nan")) - t for rid, t in added.items()],
    }


class EventSink:
    """Receives vLLM's KV event batches over ZMQ (vLLM's publisher connects to this bound
    127.0.0.1 socket) in a background thread."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind(endpoint)
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import msgspec

        while not self._stop:
            if not self._sock.poll(100):
                continue
            parts = self._sock.recv_multipart()
            batch = self._decoder.decode(parts[-1])
            with self._lock:
                for e in batch.events:
                    d = msgspec.structs.asdict(e)
                    d["type"] = type(e).__name__
                    self._events.append(d)

    def take(self, settle_s: float = 1.0) -> list[dict[str, Any]]:
        time.sleep(settle_s)  # the publisher sends from its own thread
        with self._lock:
            out, self._events = self._events, []
        return out


def _metrics(llm: Any) -> list[dict[str, Any]]:
    """The connector's series and vLLM's cache-hit counters, from vLLM's Prometheus
    registry (``LLM(..., disable_log_stats=False)``)."""
    out = []
    for m in llm.get_metrics():
        if not m.name.startswith(("vllm:lmcache_core", "vllm:prompt_tokens_cached", "vllm:ext")):
            continue
        d: dict[str, Any] = {"name": m.name, "labels": dict(m.labels)}
        for attr in ("value", "count", "sum"):
            if hasattr(m, attr):
                d[attr] = getattr(m, attr)
        out.append(d)
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    sink = EventSink(spec["kv_events_endpoint"]) if spec.get("kv_events_endpoint") else None
    t0 = time.monotonic()
    llm = LLM(**spec["engine"])
    results: dict[str, Any] = {"pid": os.getpid(), "startup_s": time.monotonic() - t0, "steps": {}}
    stats_dir = spec.get("stats_dir")
    disk_dir = spec.get("disk_dir")
    known = disk_objects(disk_dir) if disk_dir else []
    saved = 0
    for step in spec["steps"]:
        op, name = step["op"], step["name"]
        sp = SamplingParams(
            max_tokens=int(step.get("max_tokens", 6)), temperature=0.0, logprobs=1, ignore_eos=True
        )
        t1 = time.monotonic()
        rec: dict[str, Any] = {"op": op}
        if op == "generate":
            prompts = [_prompt(p, results) for p in step["prompts"]]
            loras = [_lora(p) for p in step["prompts"]]
            lora_arg = loras if any(x is not None for x in loras) else None
            outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=lora_arg)
            rec["outputs"] = [_result(o) for o in outs]
        elif op == "control":
            rec["values"] = _write_control(step, spec)
        elif op == "itl":
            rec.update(_itl(llm, step))
        elif op in ("abort_waiting", "evict_waiting"):
            rec.update(_while_waiting(llm, step, sp, spec))
        elif op == "delete_chunks":
            keys = chunk_keys(
                stats_dir, step["tokens"], int(step.get("rank", 0)), int(step.get("world_size", 1))
            )
            rec["removed"] = remove_in_other_process(
                disk_dir, stats_dir, [keys[c] for c in step["chunks"]]
            )
        elif op == "shutdown":
            llm.llm_engine.engine_core.shutdown()
        elif op == "reset_prefix_cache":
            rec["ok"] = bool(
                llm.reset_prefix_cache(reset_connector=bool(step.get("reset_connector")))
            )
        elif op == "metrics":
            rec["metrics"] = _metrics(llm)
        elif op == "events":
            assert sink is not None
            rec["events"] = sink.take()
        elif op == "abort":
            rec.update(_abort(llm, step, sp))
        elif op == "delete_disk_objects":
            assert disk_dir is not None
            rec["deleted"] = results["steps"][step["from_step"]]["new_disk_objects"]
            for rel in rec["deleted"]:
                Path(disk_dir, rel).unlink(missing_ok=True)
        else:
            raise ValueError(f"unknown op {op!r}")
        if step.get("pause_after_s"):  # the engine idles; background work goes on
            time.sleep(float(step["pause_after_s"]))
        rec["seconds"] = time.monotonic() - t1
        rec["stats"] = _stats(stats_dir)
        if disk_dir and op == "generate" and not step.get("no_disk_wait"):
            # Write-through to disk runs in the background: wait for this step's chunks.
            now_saved = _saved_chunks(rec["stats"])
            now = wait_disk_stable(disk_dir, at_least=len(known) + now_saved - saved)
            saved = now_saved
            rec["new_disk_objects"] = sorted(set(now) - set(known))
            known = now
        results["steps"][name] = rec
    return results


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    for k, v in spec.get("env", {}).items():
        os.environ[k] = str(v)
    for k in spec.get("unset_env", []):
        os.environ.pop(k, None)
    results = run(spec)
    Path(out_path).write_text(json.dumps(results))
    # Exit without waiting for vLLM's slow teardown of a finished run.
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    main(*sys.argv[1:3])
