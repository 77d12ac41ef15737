"""``make bench`` (benchmarks/run_all.py) runs every benchmark but the peer comparison."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import run_all  # noqa: E402


def test_every_benchmark_but_peer_runs_with_small_arguments():
    files = {p.stem for p in (ROOT / "benchmarks").glob("bench_*.py")}
    assert set(run_all.benchmarks()) == files - {"bench_peer"}
    assert set(run_all.SMALL) == files - {"bench_peer"}  # each has small sizes


def test_list_prints_the_commands_and_an_unknown_name_is_an_error():
    script = str(ROOT / "benchmarks" / "run_all.py")
    res = subprocess.run(
        [sys.executable, script, "--list"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0
    assert "=== bench_disk: " in res.stdout and "bench_peer" not in res.stdout
    bad = subprocess.run(
        [sys.executable, script, "--only", "bench_nope"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "unknown benchmark(s) ['bench_nope']" in bad.stderr
