"""Run every benchmark once with small sizes (``make bench``); exit 1 if one fails.

Each benchmark runs as its own process, one after the other, with the arguments in
:data:`SMALL` (sizes that finish in seconds to a minute on a 2-core machine; the numbers
are smoke-level, for real measurements run a benchmark on its own with its defaults).
The side-by-side comparison with LMCache (``bench_peer.py``) has its own target,
``make bench-peer``. A benchmark added to this folder runs with no arguments until it
gets an entry here.

    python benchmarks/run_all.py [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Benchmarks left out of ``make bench`` (each has its own target).
EXCLUDED = {"bench_peer"}
#: Small arguments per benchmark.
SMALL: dict[str, list[str]] = {
    "bench_async_load": ["--procs", "1", "--docs", "2", "--rounds", "1", "--chunks", "2"],
    "bench_codec_ttft": ["--chunks", "2", "--rounds", "1", "--codec", "int8"],
    "bench_copy": ["--rounds", "3", "--block", "2"],
    "bench_cpu_backend": [],
    "bench_cpu_storm": ["1"],
    "bench_disk": ["--sizes", "4", "--total-mib", "64", "--repeats", "1", "--steady"],
    "bench_disk_ops": ["--rounds", "1"],
    "bench_flushes": ["--files", "8", "--mib", "1", "--repeats", "3"],
    "bench_gds": ["--sizes", "4", "--total-mib", "64", "--repeats", "1"],
    "bench_gather": ["--rounds", "2", "--block", "2", "--cache-mib", "32", "--blocks", "128"],
    "bench_hierarchy": ["--rounds", "3", "--iters", "50"],
    "bench_load_copy": ["--chunks", "2", "--rounds", "2", "--block", "1"],
    "bench_loop_stall": ["--seconds", "0.5", "wt", "disk"],
    "bench_nice_gil": ["--burners", "1", "--nice", "0", "10", "--seconds", "0.5", "--rounds", "1"],
    "bench_placement": ["--chunks", "20000", "--rounds", "3"],
    "bench_save_copy": ["--chunks", "4", "--rounds", "2", "--layers", "2"],
    "bench_small_pages": ["--chunks", "4", "--mib", "4", "--repeats", "2"],
    "bench_s3": ["--reps", "1", "--sizes", "4", "--concurrency", "1,4"],
    "bench_sync": ["--rounds", "3", "--block", "10"],
    "bench_token_db": [],
    "bench_vllm": ["--scenario", "hit", "--prompts", "1", "--pairs", "1"],
}


def benchmarks() -> list[str]:
    """Names of the benchmarks ``make bench`` runs, sorted."""
    return sorted(p.stem for p in HERE.glob("bench_*.py") if p.stem not in EXCLUDED)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks")
    ap.add_argument("--list", action="store_true", help="print the commands and exit")
    args = ap.parse_args(argv)
    names = benchmarks()
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            ap.error(f"unknown benchmark(s) {unknown}; known: {names}")
        names = [n for n in names if n in args.only]
    failed: list[str] = []
    for name in names:
        cmd = [sys.executable, str(HERE / f"{name}.py"), *SMALL.get(name, [])]
        print(f"=== {name}: {' '.join(cmd[1:])}", flush=True)
        if args.list:
            continue
        start = time.monotonic()
        rc = subprocess.run(cmd, cwd=HERE.parent).returncode
        took = time.monotonic() - start
        print(
            f"=== {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {took:.0f} s", flush=True
        )
        if rc != 0:
            failed.append(name)
    if failed:
        print(f"=== FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"=== all {len(names)} benchmarks ran", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
