"""Answer quality with decoded KV (``lmcache-core bench codecs --from-engine --model``).

Each prompt is longer than the part loaded from the tier: its first ``prefix_tokens``
(whole chunks) are stored by a first request that is only that prefix, so the second
request -- the whole prompt -- loads exactly the prefix from the tier (decoded by the
tier's codec) and computes every further position on top of it. The computed positions
are scored (vLLM's prompt logprobs of the prompt's own tokens: held-out perplexity), and
``gen_tokens`` greedy tokens are generated after the prompt.

One engine per codec (in this process, one after the other), each with a disk-only tier
coded by that codec; the first engine's tier has no codec (``exact``: the loaded KV is
the computed KV, bit for bit), and a second exact engine on its own tier (``exact A/A``)
shows what two identical set-ups differ by. Requests set ``skip_reading_prefix_cache=False`` (vLLM
skips the cache when prompt logprobs are asked otherwise) and every prompt must report
hit tokens (> 0), or the run is refused: a run that loads nothing measures nothing.

Scoring (:func:`score_runs`, pure): perplexity over the positions every run computed and
scored; its change against ``exact`` with a 95% bootstrap interval over prompts (paired:
the same prompts, the same positions); greedy agreement = share of generated tokens
before the first difference from ``exact``.
"""

from __future__ import annotations

import gc
import math
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "QualityRun",
    "format_quality",
    "measure_quality",
    "quality_prompts",
    "score_runs",
]


@dataclass
class QualityRun:
    """What one engine run gives for each prompt: hit tokens, the prompt's logprobs
    (``None`` where vLLM computed none: loaded positions) and the greedy tokens; plus the
    worker's connector statistics."""

    label: str
    hits: list[int]
    logprobs: list[list[float | None]]
    tokens: list[list[int]]
    stats: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------- prompts
def quality_prompts(
    model: str | os.PathLike[str], count: int, tokens: int, seed: int = 0
) -> list[list[int]]:
    """``count`` prompts of ``tokens`` tokens: windows of the trained model's held-out
    split when ``model`` is the trained measuring model, else seeded random tokens."""
    import json

    from ..integrations.vllm import trained_model

    path = Path(model)
    if (path / trained_model.METADATA).is_file():
        return trained_model.heldout_windows(path, tokens, count)
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(tokens)] for _ in range(count)]


# ---------------------------------------------------------------------------- engine runs
#: Lookup and load deadlines of the quality runs (see :func:`engine_run`).
LOOKUP_DEADLINE_MS = 120_000.0


def _scheduler_stats(llm: Any) -> dict[str, Any]:
    """The connector's scheduler-side counters that explain a short hit (in-process
    engine); empty when vLLM's internals are not where this vLLM keeps them."""
    try:
        side = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler
        st = side.stats()
    except AttributeError:
        return {}
    keep = (
        "hit_tokens",
        "lookup_deadline_misses",
        "lookup_errors",
        "load_failures",
        "failed_chunks",
    )
    return {k: st.get(k) for k in keep}


def _connector_worker() -> Any:
    """The worker side of this process's connector (the engine runs in this process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    return getattr(get_kv_transfer_group(), "_worker", None)


def wait_saves(timeout_s: float = 120.0) -> int:
    """Wait until this process's connector has every gathered chunk in every tier;
    returns how many were still pending at the timeout (0: all stored)."""
    deadline = time.monotonic() + timeout_s
    while True:
        w = _connector_worker()
        if w is None or w.saves is None or w.storage is None:
            return 0
        pending = int(w.saves.pending) + int(w.storage.stats()["pending_stores"])
        if pending == 0 or time.monotonic() > deadline:
            return pending
        time.sleep(0.01)


def _worker_stats() -> dict[str, Any]:
    w = _connector_worker()
    if w is None:
        return {}
    st = w.stats()
    keep = (
        "loaded_chunks",
        "failed_chunks",
        "saved_chunks",
        "gathered_chunks",
        "rejected_saves",
        "dropped_saves_staging_full",
        "skipped_saves",
        "async_load_deadline_misses",
    )
    out: dict[str, Any] = {k: st.get(k) for k in keep}
    for t in st.get("tiers", []):
        for k in ("hits", "misses", "stores", "store_failures", "dropped_stores", "errors"):
            out[f"tier_{k}"] = t.get(k)
        codec = t.get("codec") or {}
        out["decode_errors"] = codec.get("decode_errors", 0)
        out["encode_errors"] = codec.get("encode_errors", 0)
    return out


def engine_run(
    model: str,
    prompts: Sequence[Sequence[int]],
    prefix_tokens: int,
    root: Path,
    label: str,
    codec: dict[str, Any] | None,
    chunk: int,
    gen_tokens: int,
) -> QualityRun:
    """One engine with a disk-only tier under ``root`` coded by ``codec`` (``None``: no
    codec): store each prompt's first ``prefix_tokens``, then score the whole prompts
    with that prefix loaded (see the module docstring)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tier: dict[str, Any] = {"name": "disk", "backend": "disk", "options": {"path": str(root)}}
    if codec is not None:
        tier["codec"] = codec
    longest = max(len(p) for p in prompts)
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=max(1024, -(-(longest + gen_tokens + 1) // chunk) * chunk),
        block_size=chunk,
        enable_prefix_caching=False,
        kv_transfer_config={
            "kv_connector": "LMCacheCoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "config": {"chunk_size": chunk, "tiers": [tier]},
                # every prompt is submitted at once: on a busy machine a lookup queued
                # behind the others' loads can pass the default 20 ms deadline and make
                # its prompt a miss (measured: docs/codecs.md); quality needs every hit
                "lookup_deadline_ms": LOOKUP_DEADLINE_MS,
                "load_deadline_s": LOOKUP_DEADLINE_MS / 1000,
            },
        },
    )
    try:
        heads = [TokensPrompt(prompt_token_ids=list(p[:prefix_tokens])) for p in prompts]
        llm.generate(heads, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        left = wait_saves()
        if left:
            raise RuntimeError(f"{label}: {left} chunk stores still pending after 120 s")
        stored = {**_worker_stats(), **_scheduler_stats(llm)}
        sp = SamplingParams(
            max_tokens=gen_tokens,
            temperature=0.0,
            ignore_eos=True,
            prompt_logprobs=0,
            skip_reading_prefix_cache=False,  # vLLM skips the cache for prompt logprobs otherwise
            detokenize=False,  # vLLM would decode the -1 ids it reports for loaded positions
        )
        toks = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outs = llm.generate(toks, sp, use_tqdm=False)
        run = QualityRun(label=label, hits=[], logprobs=[], tokens=[])
        for p, out in zip(prompts, outs, strict=True):
            run.hits.append(int(out.num_cached_tokens or 0))
            scored = out.prompt_logprobs or []
            run.logprobs.append(
                [
                    None if e is None or tok not in e else float(e[tok].logprob)
                    for tok, e in zip(p, scored, strict=False)
                ]
            )
            run.tokens.append(list(out.outputs[0].token_ids))
        wait_saves()
        run.stats = {
            "after_store": stored,
            "after_score": {**_worker_stats(), **_scheduler_stats(llm)},
        }
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return run


def measure_quality(
    model: str,
    prompts: Sequence[Sequence[int]],
    codecs: Sequence[tuple[str, dict[str, Any]]],
    workdir: str | os.PathLike[str],
    prefix_tokens: int,
    chunk: int = 128,
    gen_tokens: int = 16,
    aa: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, QualityRun]]:
    """Score ``exact`` (no codec) and each codec of ``codecs`` (see the module
    docstring); returns :func:`score_runs`'s rows and the runs. With ``aa``, a second
    exact run (``exact A/A``, its own tier) shows what the comparison gives between two
    identical set-ups."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ..codecs import codec_label

    if prefix_tokens <= 0 or prefix_tokens % chunk:
        raise ValueError(f"the loaded prefix must be whole chunks of {chunk}, not {prefix_tokens}")
    if any(len(p) <= prefix_tokens + 1 for p in prompts):
        raise ValueError("every prompt must be longer than its loaded prefix plus one token")
    root = Path(workdir) / "quality-tier"
    runs = {
        "exact": engine_run(model, prompts, prefix_tokens, root, "exact", None, chunk, gen_tokens)
    }
    if aa:  # the same again in a fresh tier: the noise floor of every comparison
        runs["exact A/A"] = engine_run(
            model,
            prompts,
            prefix_tokens,
            root.with_name("quality-tier-aa"),
            "exact A/A",
            None,
            chunk,
            gen_tokens,
        )
    for name, opts in codecs:
        label = codec_label(name, opts)
        runs[label] = engine_run(
            model,
            prompts,
            prefix_tokens,
            root,
            label,
            {"name": name, "options": opts},
            chunk,
            gen_tokens,
        )
    try:
        return score_runs(runs, prefix_tokens), runs
    except RuntimeError:
        import sys

        for run in runs.values():  # what the refused runs saw, for the report
            print(f"{run.label}: hit tokens {run.hits}; connector {run.stats}", file=sys.stderr)
        raise


# ---------------------------------------------------------------------------- scoring
def _agreement(a: Sequence[int], b: Sequence[int]) -> float:
    same = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    return same / max(1, len(a))


def _bootstrap_ratio(
    nll: Sequence[float], base: Sequence[float], n: Sequence[int], rounds: int = 2000
) -> tuple[float, float]:
    """95% interval of ``exp(sum nll / N) / exp(sum base / N) - 1`` over prompts drawn
    with replacement (paired: a draw takes a prompt's figures in both runs)."""
    rng = random.Random(0)
    idx = range(len(nll))
    out = []
    for _ in range(rounds):
        pick = rng.choices(idx, k=len(nll))
        tot = sum(n[i] for i in pick) or 1
        out.append(math.exp((sum(nll[i] for i in pick) - sum(base[i] for i in pick)) / tot) - 1)
    out.sort()
    return out[int(0.025 * rounds)], out[int(0.975 * rounds) - 1]


def score_runs(runs: dict[str, QualityRun], prefix_tokens: int) -> list[dict[str, Any]]:
    """Rows of perplexity, its change against the first run (``exact``), and greedy
    agreement with it, one per run in order (see the module docstring).

    Raises ``RuntimeError`` when a prompt of any run loaded nothing (hit tokens 0)."""
    if not runs:
        return []
    first = next(iter(runs.values()))
    count = len(first.hits)
    for run in runs.values():
        zero = [i for i, h in enumerate(run.hits) if h <= 0]
        if zero:
            raise RuntimeError(
                f"{run.label}: {len(zero)} of {count} prompts loaded nothing from the tier "
                f"(hit tokens 0; the first is prompt {zero[0]}): not a measurement of decoded KV"
            )
    # the positions every run computed (past its hit) and scored
    common: list[list[int]] = []
    for i in range(count):
        start = max(max(r.hits[i] for r in runs.values()), prefix_tokens)
        length = min(len(r.logprobs[i]) for r in runs.values())
        common.append(
            [
                j
                for j in range(start, length)
                if all(r.logprobs[i][j] is not None for r in runs.values())
            ]
        )
    if not any(common):
        raise RuntimeError("no prompt position was computed and scored by every run")
    per_prompt: dict[str, list[float]] = {}
    for label, run in runs.items():
        per_prompt[label] = [
            -sum(run.logprobs[i][j] or 0.0 for j in common[i]) for i in range(count)
        ]
    n = [len(c) for c in common]
    total = sum(n)
    base = per_prompt[first.label]
    rows = []
    for label, run in runs.items():
        nll = per_prompt[label]
        ppl = math.exp(sum(nll) / total)
        lo, hi = _bootstrap_ratio(nll, base, n) if label != first.label else (0.0, 0.0)
        agree = [_agreement(a, b) for a, b in zip(first.tokens, run.tokens, strict=True)]
        rows.append(
            {
                "codec": label,
                "prompts": count,
                "prompt_tokens": statistics.mean(len(p) for p in run.logprobs),
                "hit_tokens_min": min(run.hits),
                "hit_tokens_mean": statistics.mean(run.hits),
                "prompts_with_full_prefix": sum(1 for h in run.hits if h >= prefix_tokens),
                "scored_positions": total,
                "perplexity": ppl,
                "perplexity_change": ppl / math.exp(sum(base) / total) - 1,
                "perplexity_change_ci95": [lo, hi],
                "greedy_agreement": statistics.mean(agree),
                "greedy_identical_prompts": sum(1 for x in agree if x == 1.0) / count,
                "connector": run.stats,
            }
        )
    return rows


def format_quality(
    rows: Sequence[dict[str, Any]], gen_tokens: int, errors: dict[str, tuple[float, float]]
) -> str:
    """A Markdown table of :func:`score_runs`'s rows; ``errors`` maps a codec label to
    its (max, mean) absolute KV error."""
    lines = [
        "| codec | hit tokens / prompt (min) | perplexity | vs exact (95% CI) | "
        f"greedy agreement ({gen_tokens} tokens) | identical prompts | max abs err | mean abs err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lo, hi = r["perplexity_change_ci95"]
        exact = r["codec"].startswith("exact")
        err = errors.get(r["codec"], (0.0, 0.0) if exact else (math.nan, math.nan))
        lines.append(
            f"| `{r['codec']}` | {r['hit_tokens_mean']:.0f} ({r['hit_tokens_min']}) | "
            f"{r['perplexity']:.3f} | {r['perplexity_change']:+.2%} ({lo:+.2%}, {hi:+.2%}) | "
            f"{r['greedy_agreement']:.1%} | {r['greedy_identical_prompts']:.1%} | "
            f"{err[0]:.3g} | {err[1]:.3g} |"
        )
    return "\n".join(lines)
