"""Drive one real vLLM engine through a list of steps; started by the tests in a subprocess.

Usage: ``python engine_driver.py SPEC.json OUT.json``. The spec gives the environment,
the ``LLM(...)`` arguments and the steps; the output records, per step, the generated
tokens, their logprobs, ``num_cached_tokens`` and the connector statistics files.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

_OBJECT = re.compile(r"ns-[0-9a-f]{16}/[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{32}")


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
    return sum(int(d.get("saved_chunks", 0)) for d in stats if d.get("role") == "worker")


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
        "tokens": list(comp.token_ids),
        "logprobs": logprobs,
        "num_cached_tokens": out.num_cached_tokens,
        "finish_reason": comp.finish_reason,
    }


def _prompt(p: dict[str, Any]) -> Any:
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(p["tokens"]))
    if p.get("cache_salt"):
        prompt["cache_salt"] = p["cache_salt"]
    return prompt


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


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

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
            outs = llm.generate([_prompt(p) for p in step["prompts"]], sp, use_tqdm=False)
            rec["outputs"] = [_result(o) for o in outs]
        elif op == "reset_prefix_cache":
            rec["ok"] = bool(llm.reset_prefix_cache())
        elif op == "abort":
            rec.update(_abort(llm, step, sp))
        elif op == "delete_disk_objects":
            assert disk_dir is not None
            rec["deleted"] = results["steps"][step["from_step"]]["new_disk_objects"]
            for rel in rec["deleted"]:
                Path(disk_dir, rel).unlink(missing_ok=True)
        else:
            raise ValueError(f"unknown op {op!r}")
        rec["seconds"] = time.monotonic() - t1
        rec["stats"] = _stats(stats_dir)
        if disk_dir and op == "generate":
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
