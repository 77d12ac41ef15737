"""Run the simulator over families x capacities x policies; tabulate and plot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .simulator import SimConfig, SimResult, simulate, working_set_bytes
from .traces import Request

if TYPE_CHECKING:
    from .bound import Bound

__all__ = ["BASELINES", "Cell", "best_baseline_gain", "bound_gain", "plot_cells", "run_grid"]

#: The policies the cost-aware one is compared with.
BASELINES = ("lru", "arc", "s3fifo")


@dataclass
class Cell:
    """One (trace, capacity fraction) with every policy's result."""

    trace: str
    fraction: float
    working_set_bytes: int
    results: dict[str, SimResult]
    #: With ``--bound``: the upper bound on the prefill seconds any policy saves here.
    bound: Bound | None = None


def run_grid(
    traces: dict[str, Sequence[Request]],
    fractions: Sequence[float],
    policies: Sequence[str],
    base: SimConfig,
    oracle: bool = False,
    bound: bool = False,
) -> list[Cell]:
    """Simulate every policy on every trace at each capacity fraction of its working set
    (with ``oracle``, also :class:`~lmcache_core.placement.oracle.BeladyOracle`, which
    reads the future, and :class:`~lmcache_core.placement.oracle.StaticOracle`, the best
    fixed content with hindsight: references, not policies; with ``bound``, also
    :func:`~lmcache_core.placement.bound.prefill_bound`, the upper bound on what any
    policy saves)."""
    from .bound import prefill_bound
    from .oracle import BeladyOracle, StaticOracle

    cells = []
    for name, trace in traces.items():
        ws = working_set_bytes(trace, base.kv_bytes_per_token)
        for frac in fractions:
            cfg = replace(base, capacity_bytes=int(ws * frac))
            results = {p: simulate(trace, p, cfg) for p in policies}
            if oracle:
                results["oracle"] = simulate(
                    trace, BeladyOracle(trace, cfg.kv_bytes_per_token), cfg
                )
                results["static"] = simulate(trace, StaticOracle(trace, cfg), cfg)
            cell = Cell(name, frac, ws, results)
            if bound:
                best = max((r.compute_s_saved for r in results.values()), default=0.0)
                cell.bound = prefill_bound(trace, cfg, target=best)
            cells.append(cell)
    return cells


def best_baseline_gain(cell: Cell, policy: str = "cost") -> float | None:
    """Relative prefill compute saved by ``policy`` over the best baseline in the cell
    (0.10 = 10% more); ``None`` when either is missing or the baselines saved nothing."""
    if policy not in cell.results:
        return None
    base = [cell.results[b].compute_s_saved for b in BASELINES if b in cell.results]
    if not base or max(base) <= 0:
        return None
    return cell.results[policy].compute_s_saved / max(base) - 1.0


def bound_gain(cell: Cell) -> float | None:
    """How far the upper bound lies above the best baseline in the cell (0.10 = 10%):
    no policy can beat that baseline by more. ``None`` without a bound or a baseline."""
    base = [cell.results[b].compute_s_saved for b in BASELINES if b in cell.results]
    if cell.bound is None or not base or max(base) <= 0:
        return None
    return cell.bound.seconds / max(base) - 1.0


def plot_cells(cells: Sequence[Cell], path: str | Path, price_per_hour: float | None) -> None:
    """One row per trace; columns: hit ratio, prefill tokens saved, mean and p99 TTFT,
    compute (or currency) per 1k prompt tokens, each versus tier size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(c.trace for c in cells))
    cost_label = "currency / 1k prompt tokens" if price_per_hour else "compute-s / 1k prompt tokens"
    metrics: list[tuple[str, Callable[[SimResult], float]]] = [
        ("hit ratio", lambda r: r.hit_ratio),
        ("prefill tokens saved", lambda r: float(r.tokens_saved)),
        ("mean TTFT (s)", lambda r: r.ttft_mean_s),
        ("p99 TTFT (s)", lambda r: r.ttft_p99_s),
        (
            cost_label,
            lambda r: r.compute_s_per_1k_tokens * ((price_per_hour or 3600.0) / 3600.0),
        ),
    ]
    fig, axes = plt.subplots(
        len(traces), len(metrics), figsize=(3.2 * len(metrics), 2.4 * len(traces)), squeeze=False
    )
    for row, name in enumerate(traces):
        mine = [c for c in cells if c.trace == name]
        xs = [100 * c.fraction for c in mine]
        for col, (label, fn) in enumerate(metrics):
            ax = axes[row][col]
            for pol in mine[0].results:
                ax.plot(xs, [fn(c.results[pol]) for c in mine], marker="o", label=pol)
            ax.set_xlabel("tier size, % of working set", fontsize=7)
            ax.set_title(f"{name}: {label}", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(str(path), dpi=56)
    plt.close(fig)
