"""``lmcache-core simulate``: replay traces through a tier model for each placement policy.

Traces come from ``--trace FILE`` (JSON lines: lmcache-core's own form or the Mooncake
trace's, see :mod:`lmcache_core.placement.traces`) or from the built-in generators
(``--family``, default: all five). Each runs at tier sizes that are fractions of its
working set (``--capacities``), once per policy; the table (or JSON) reports hit ratio,
prefill tokens and compute saved, mean/p99 TTFT and compute per 1k prompt tokens, and
``--plot`` draws them versus tier size (needs matplotlib: ``pip install
'lmcache-core[plot]'``). ``--write-trace`` saves a generated family as JSON lines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..tables import format_table
from .main import add_output_flags, print_json, wants_json

__all__ = ["positive_floats", "register", "run_simulate"]


def positive_floats(text: str) -> list[float]:
    """argparse type: comma-separated positive numbers."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not out or any(not x > 0 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return out


def register(subparsers: Any) -> None:
    from ..placement import FAMILIES, POLICIES

    p = subparsers.add_parser(
        "simulate",
        help="replay request traces through a tier model for each placement policy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="FILE",
        help="a JSON-lines trace (repeatable); default: the generated families",
    )
    p.add_argument(
        "--family",
        action="append",
        default=[],
        choices=list(FAMILIES),
        help="a generated trace family (repeatable; default all when no --trace)",
    )
    p.add_argument("--seed", type=int, default=0, help="generators' seed (default 0)")
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated (default {','.join(POLICIES)})",
    )
    p.add_argument(
        "--capacities",
        type=positive_floats,
        default=[0.1, 0.25, 0.5],
        help="tier sizes as fractions of each trace's working set (default 0.1,0.25,0.5)",
    )
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk (default 256)")
    p.add_argument(
        "--block-tokens",
        type=int,
        default=512,
        help="tokens per hash_ids block of a Mooncake trace (default 512)",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=131072,
        help="KV bytes per token (default 131072: an 8B GQA model, 16-bit)",
    )
    p.add_argument(
        "--bandwidth-gbps", type=float, default=10.0, help="tier load bandwidth, GB/s (default 10)"
    )
    p.add_argument("--latency-ms", type=float, default=0.0, help="tier latency per chunk load")
    p.add_argument(
        "--tokens-per-s",
        type=float,
        default=8000.0,
        help="prefill throughput on short prompts (default 8000)",
    )
    p.add_argument(
        "--attn-tokens",
        type=float,
        default=16384.0,
        help="prompt length where attention costs as much as the rest (default 16384)",
    )
    p.add_argument(
        "--price-per-hour",
        type=float,
        default=None,
        help="accelerator price per hour: also report currency per 1k prompt tokens",
    )
    p.add_argument(
        "--oracle",
        action="store_true",
        help="also replay two clairvoyant references: Belady (evicts the chunk requested "
        "farthest in the future) and the best fixed content chosen with hindsight "
        "(static); they show the room left above the policies",
    )
    p.add_argument(
        "--bound",
        action="store_true",
        help="also compute an upper bound on the prefill compute any policy (online or "
        "clairvoyant) saves (a Lagrangian bound on the trace's linear relaxation, "
        "docs/placement.md); prints how far it lies above the best baseline",
    )
    p.add_argument("--plot", metavar="PNG", help="write the plot to this PNG file")
    p.add_argument(
        "--write-trace",
        metavar="FILE",
        help="write the (single) generated --family trace as JSON lines and exit",
    )
    add_output_flags(p)
    p.set_defaults(func=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    """Handler of ``lmcache-core simulate``; returns the exit status."""
    from ..placement import (
        FAMILIES,
        POLICIES,
        PrefillCost,
        SimConfig,
        TraceError,
        generate,
        read_trace,
    )
    from ..placement.report import BASELINES, best_baseline_gain, bound_gain, plot_cells, run_grid
    from ..placement.traces import write_trace

    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in policies if x not in POLICIES]
    if unknown or not policies:
        print(
            f"simulate: unknown policy {', '.join(unknown) or '(none)'}; known: "
            f"{', '.join(POLICIES)}",
            file=sys.stderr,
        )
        return 2
    if args.write_trace:
        if len(args.family) != 1 or args.trace:
            print("simulate: --write-trace needs exactly one --family", file=sys.stderr)
            return 2
        with open(args.write_trace, "w", encoding="utf-8") as f:
            write_trace(generate(args.family[0], args.seed), f)
        print(f"wrote {args.write_trace}")
        return 0
    try:
        cost = PrefillCost(args.tokens_per_s, args.attn_tokens)
        base = SimConfig(
            0, args.kv_bytes_per_token, args.bandwidth_gbps * 1e9, args.latency_ms / 1000.0, cost
        )
        traces: dict[str, Any] = {}
        for path in args.trace:
            traces[Path(path).name] = read_trace(path, args.chunk_tokens, args.block_tokens)
        families = args.family or ([] if args.trace else list(FAMILIES))
        for fam in families:
            traces[fam] = generate(fam, args.seed)
    except (OSError, TraceError, ValueError) as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 2
    cells = run_grid(traces, args.capacities, policies, base, oracle=args.oracle, bound=args.bound)
    price = args.price_per_hour
    rows = []
    for c in cells:
        gain = best_baseline_gain(c)
        for name, r in c.results.items():
            row: dict[str, Any] = {
                "trace": c.trace,
                "capacity_fraction": c.fraction,
                "capacity_gib": round(r.capacity_bytes / 2**30, 3),
                "policy": name,
                "hit_ratio": round(r.hit_ratio, 4),
                "tokens_saved": r.tokens_saved,
                "compute_s_saved": round(r.compute_s_saved, 3),
                "vs_best_baseline": (
                    round(gain, 4) if name == "cost" and gain is not None else None
                ),
                "ttft_mean_ms": round(1000 * r.ttft_mean_s, 2),
                "ttft_p99_ms": round(1000 * r.ttft_p99_s, 2),
                "compute_s_per_1k_tokens": round(r.compute_s_per_1k_tokens, 5),
            }
            if price is not None:
                row["price_per_1k_tokens"] = round(r.compute_s_per_1k_tokens * price / 3600.0, 6)
            rows.append(row)
    if args.plot:
        try:
            plot_cells(cells, args.plot, price)
        except ImportError:
            print(
                "simulate: --plot needs matplotlib: pip install 'lmcache-core[plot]'",
                file=sys.stderr,
            )
            return 2
    bounds = [
        {
            "trace": c.trace,
            "capacity_fraction": c.fraction,
            "bound_compute_s_saved": round(c.bound.seconds, 3),
            "best_baseline_to_bound": round(g, 4) if (g := bound_gain(c)) is not None else None,
            "cost_vs_best_baseline": (
                round(x, 4) if (x := best_baseline_gain(c)) is not None else None
            ),
        }
        for c in cells
        if c.bound is not None
    ]
    if wants_json(args):
        doc: dict[str, Any] = {"baselines": list(BASELINES), "rows": rows}
        if args.bound:
            doc["bounds"] = bounds
        print_json(doc)
    else:
        header = list(rows[0]) if rows else []
        print(format_table([[r[h] for h in header] for r in rows], header))
        for c in cells:
            gain = best_baseline_gain(c)
            if gain is not None:
                print(
                    f"{c.trace} @ {100 * c.fraction:g}%: cost-aware vs best of "
                    f"{'/'.join(b for b in BASELINES if b in c.results)}: {100 * gain:+.1f}% "
                    "prefill compute saved"
                )
        for c in cells:
            if c.bound is None:
                continue
            room = bound_gain(c)
            print(
                f"{c.trace} @ {100 * c.fraction:g}%: upper bound {c.bound.seconds:.1f} "
                "compute-s saved"
                + (f", {100 * room:+.1f}% above the best baseline" if room is not None else "")
            )
        if args.plot:
            print(f"plot: {args.plot}")
    return 0
