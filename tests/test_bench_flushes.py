"""benchmarks/bench_flushes.py runs end to end on a small batch and prints every
contender with its ratios and the A/A spread (figures: docs/performance.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_core import flushes

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_flushes.py"


def test_bench_flushes_runs_and_reports_every_contender(tmp_path: Path) -> None:
    if not flushes.native():
        pytest.skip("lmcache_core's compiled module was not built here")
    env = {k: v for k, v in os.environ.items() if k != flushes.FLUSHES_ENV}
    args = ["--files", "3", "--mib", "1", "--repeats", "2", "--dir", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    ).stdout
    for name in ("raw", "two waves", "one wave, python", "one wave, compiled"):
        assert f"| {name} |" in out, out
    assert "A/A spread" in out
    assert list(tmp_path.iterdir()) == []  # its files are removed


def test_bench_flushes_refuses_without_the_compiled_helper(tmp_path: Path) -> None:
    env = dict(os.environ, **{flushes.FLUSHES_ENV: "python"})
    res = subprocess.run(
        [sys.executable, str(BENCH), "--files", "2", "--mib", "1", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode != 0 and "compiled module is not built" in res.stderr
