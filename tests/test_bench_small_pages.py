"""benchmarks/bench_small_pages.py runs end to end on a small batch and prints every
contender of both tables with device requests, ratios and the A/A spreads (figures:
docs/performance.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_small_pages.py"


def test_bench_small_pages_runs_and_reports_every_contender(tmp_path: Path) -> None:
    args = ["--chunks", "2", "--mib", "4", "--repeats", "2", "--dir", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout
    for kind in ("read", "put"):
        assert f"| {kind} of the batch |" in out, out
        assert f"{kind}: A/A spread (stage against itself)" in out, out
    for name in ("raw, huge pages", "raw, small pages", "tier, direct", "tier, stage"):
        assert out.count(f"| {name} |") == 2, out  # one row per table
    assert "small_pages=auto here:" in out
    assert list(tmp_path.iterdir()) == []  # its files are removed
