"""Host-copy primitives behind the cpu backend and the token database, measured here.

1. A 2, 4, 8 and 32 MiB copy into a reused buffer, from sources taken in turn (128 MiB
   of them, so each copy reads memory, not cache, as a cache tier's hits do), three ways:
   ``torch.Tensor.copy_`` (split across torch's OpenMP threads: 2 on this machine), one
   ``memmove`` through ctypes in the calling thread, and
   ``lmcache_core.memory.copy_into`` (``memmove``, shared with its helper thread from
   ``SPLIT_MIN`` bytes on: the caller copies the first half, then caller and helper
   take pieces of the rest from both ends; the compiled helper of
   ``lmcache_core._speedups`` where it was built, else the Python one: the first line
   says which), in two conditions:

   * quiet: nothing else started by this benchmark (the machine may still be shared:
     the load average is printed);
   * loaded: one busy process per core (``os.cpu_count()`` processes), each running
     float32 1024x1024 matmuls on one torch thread in a loop -- other processes
     computing on every core, as a vLLM worker's forward pass and other engines do.

   Each contender runs twice under two names (A and B), all four interleaved in blocks,
   so the A/A spread (A's median / B's median of the same contender) shows how far two
   measurements of one thing differ in the same conditions. Medians and 90th
   percentiles are printed: a stalled OpenMP team shows in both.
2. Per-call overhead of a 1 KiB copy: ``copy_into`` vs ``numpy.copyto`` on fresh views.
3. Packing 32k Python ints as int32: module-level ``struct.pack`` vs a compiled ``Struct``
   (and the compiled ``lmcache_core._speedups.int32_le`` where it was built).

With ``--fresh`` only this runs instead: a 4 MiB copy into fresh memory, the staging
pool's question (``lmcache_core.hierarchy.staging``): into a new ``torch.empty`` (every
page faulted on first write), into ``lmcache_core.memory.populated_empty`` (allocation
included: the mapping is faulted in by ``MAP_POPULATE``), and into a reused buffer (A and
B: the A/A spread), interleaved; every fresh buffer stays alive until the end, so none
reuses another's pages.

Run: .venv/bin/python benchmarks/bench_copy.py [--rounds 21] [--block 5] [--fresh]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _util import aa_spread, interleaved_samples, pct

from lmcache_core import memory, token_db
from lmcache_core.memory import SPLIT_MIN, copy_into, populated_empty

MiB = 1 << 20


def _busy(stop_at: float) -> None:
    """One core's worth of compute: float32 matmuls on one torch thread."""
    torch.set_num_threads(1)
    a = torch.randn(1024, 1024)
    while time.time() < stop_at:
        a @ a


def start_load(seconds: float) -> list[mp.process.BaseProcess]:
    """One busy process per core; returns them (terminate when done)."""
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = [
        ctx.Process(target=_busy, args=(time.time() + seconds,), daemon=True)
        for _ in range(os.cpu_count() or 1)
    ]
    for p in procs:
        p.start()
    time.sleep(3.0)  # let them import torch and reach their loops
    return procs


def stop_load(procs: list[mp.process.BaseProcess]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.join()


def copies(label: str, nbytes: int, rounds: int, block: int) -> dict[str, float]:
    srcs = [
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        for _ in range(max(2, 128 * MiB // nbytes))
    ]
    dst = torch.empty_like(srcs[0])
    dst.fill_(0)  # fault the pages in: a reused buffer
    turn = [0]

    def src() -> torch.Tensor:
        turn[0] += 1
        return srcs[turn[0] % len(srcs)]

    def memmove() -> None:
        s = src()
        ctypes.memmove(dst.data_ptr(), s.data_ptr(), nbytes)

    _, helped, stalls = memory.shared_copy_stats()
    s = interleaved_samples(
        {
            "torch A": lambda: dst.copy_(src()),
            "memmove A": memmove,
            "copy_into A": lambda: copy_into(dst, src()),
            "torch B": lambda: dst.copy_(src()),
            "memmove B": memmove,
            "copy_into B": lambda: copy_into(dst, src()),
        },
        rounds=rounds,
        block=block,
    )
    _, helped_now, stalls_now = memory.shared_copy_stats()
    helped, stalls = helped_now - helped, stalls_now - stalls
    copy_into(dst, srcs[0])
    assert torch.equal(dst, srcs[0])
    gbs = nbytes / 1e9
    meds = {}
    parts = []
    for name in ("torch", "memmove", "copy_into"):
        both = s[f"{name} A"] + s[f"{name} B"]
        meds[name] = med = pct(both, 50)
        meds[f"{name} p90"] = pct(both, 90)
        parts.append(
            f"{name} {med * 1e3:6.3f} ms ({gbs / med:5.1f} GB/s, p90 {pct(both, 90) * 1e3:7.3f}"
            f" ms, A/A {aa_spread(s[f'{name} A'], s[f'{name} B']):.2f})"
        )
    print(f"{nbytes // MiB:3d} MiB, {label:7s} " + " | ".join(parts))
    print(
        f"{'':16s}speed vs torch copy_, median (p90): memmove "
        f"{meds['torch'] / meds['memmove']:.2f}x ({meds['torch p90'] / meds['memmove p90']:.2f}x)"
        f", copy_into {meds['torch'] / meds['copy_into']:.2f}x "
        f"({meds['torch p90'] / meds['copy_into p90']:.2f}x); copy_into vs memmove "
        f"{meds['memmove'] / meds['copy_into']:.2f}x ({meds['memmove p90'] / meds['copy_into p90']:.2f}x)"
        f"; copy_into calls the helper took part in: {helped}, stalls (sharing paused): {stalls}"
    )
    return meds


def fresh_memory(rounds: int, block: int) -> None:
    """4 MiB copies into fresh, pre-faulted and reused memory (see the module docstring)."""
    n = 4 * MiB
    src = torch.full((n,), 7, dtype=torch.uint8)
    reused = torch.empty(n, dtype=torch.uint8)
    keep: list[torch.Tensor] = []

    def into_empty() -> None:
        dst = torch.empty(n, dtype=torch.uint8)
        copy_into(dst, src)
        keep.append(dst)

    def into_populated() -> None:
        dst = populated_empty(n)
        copy_into(dst, src)
        keep.append(dst)

    s = interleaved_samples(
        {
            "new torch.empty": into_empty,
            "populated_empty": into_populated,
            "reused A": lambda: copy_into(reused, src),
            "reused B": lambda: copy_into(reused, src),
        },
        rounds=rounds,
        block=block,
    )
    base = pct(s["reused A"] + s["reused B"], 50)
    aa = aa_spread(s["reused A"], s["reused B"])
    print(f"4 MiB copy, load average {os.getloadavg()[0]:.1f}; A/A spread of reused {aa:.2f}")
    for name in ("new torch.empty", "populated_empty", "reused A", "reused B"):
        med = pct(s[name], 50)
        print(
            f"  {name:16s} median {med * 1e3:7.3f} ms  p90 {pct(s[name], 90) * 1e3:7.3f} ms"
            f"  = {med / base:5.2f}x reused"
        )
    keep.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21, help="rounds of interleaved blocks")
    ap.add_argument("--block", type=int, default=5, help="calls per contender per round")
    ap.add_argument("--fresh", action="store_true", help="only the fresh-memory copies")
    args = ap.parse_args()
    if args.fresh:
        fresh_memory(args.rounds, args.block)
        return
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
        f"{os.cpu_count()} cores, copy_into shares copies of >= {SPLIT_MIN} bytes "
        f"({memory.shared_copy_stats()[0]} helper), "
        f"load average before: {os.getloadavg()[0]:.1f}"
    )
    sizes = (2 * MiB, 4 * MiB, 8 * MiB, 32 * MiB)
    for n in sizes:
        copies("quiet", n, args.rounds, args.block)
    procs = start_load(600)
    try:
        print(f"loaded: {len(procs)} processes, each float32 1024x1024 matmuls on 1 thread")
        for n in sizes:
            copies("loaded", n, args.rounds, args.block)
    finally:
        stop_load(procs)
    print(f"load average after: {os.getloadavg()[0]:.1f}")

    a = torch.empty(1024, dtype=torch.uint8)
    b = torch.empty_like(a)
    s = interleaved_samples(
        {
            "copy_into": lambda: copy_into(b, a),
            "numpy": lambda: np.copyto(b.numpy(), a.numpy()),
        },
        rounds=40,
        block=50,
    )
    print(
        f"1 KiB copy overhead: copy_into {pct(s['copy_into'], 50) * 1e6:.1f} us, "
        f"numpy.copyto on fresh views {pct(s['numpy'], 50) * 1e6:.1f} us"
    )

    ints = list(range(32768))
    packer = struct.Struct("<32768i").pack
    fns: dict[str, Callable[[], object]] = {
        "module": lambda: struct.pack("<32768i", *ints),
        "compiled": lambda: packer(*ints),
    }
    native = token_db._native_int32_le
    if native is not None:
        assert native(ints) == packer(*ints)
        fns["native"] = lambda: native(ints)
    s = interleaved_samples(fns, rounds=12, block=5)
    print(
        f"32k ints -> int32: struct.pack {pct(s['module'], 50) * 1e6:.0f} us, "
        f"compiled Struct.pack {pct(s['compiled'], 50) * 1e6:.0f} us"
        + (f", _speedups.int32_le {pct(s['native'], 50) * 1e6:.0f} us" if native else "")
    )


if __name__ == "__main__":
    main()
