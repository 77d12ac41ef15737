"""``make bench`` (benchmarks/run_all.py) runs every benchmark but the peer comparison."""

from __future__ import annotations

import json
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


_PARSE_ONLY = """
import argparse, json, runpy, sys
sys.path.insert(0, sys.argv[1])
import run_all


class Parsed(Exception):
    pass


def parse_args(self, args=None, namespace=None):
    raise Parsed(self.parse_known_args(args, namespace)[1])


argparse.ArgumentParser.parse_args = parse_args
left = {}
for name in json.loads(sys.argv[2]):
    sys.argv = [f"{name}.py", *run_all.SMALL.get(name, [])]
    try:
        runpy.run_path(f"{run_all.HERE}/{name}.py", run_name="__main__")
        left[name] = "never parsed its arguments"
    except Parsed as e:
        left[name] = e.args[0]
print(json.dumps(left))
"""


def test_every_small_argument_set_is_accepted_by_its_benchmark():
    """`make bench` passes SMALL's arguments: an option a benchmark no longer takes (the
    parser is stopped right after parsing, so nothing is measured) fails here, not there."""
    with_parser = [
        n
        for n in run_all.benchmarks()
        if "ArgumentParser" in (ROOT / "benchmarks" / f"{n}.py").read_text()
    ]
    assert "bench_vllm" in with_parser
    res = subprocess.run(
        [sys.executable, "-c", _PARSE_ONLY, str(ROOT / "benchmarks"), json.dumps(with_parser)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    left = json.loads(res.stdout.strip().splitlines()[-1])
    assert left == {n: [] for n in with_parser}
