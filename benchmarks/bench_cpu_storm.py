"""cpu backend under a put storm: memory maps (the default) against C-heap buffers.

Each run is its own process (RSS is per process): a warmed-up ``cpu`` tier of 256 MiB
takes 2,000 puts over 5,000 keys and the run reports microseconds per put and the RSS
growth over its baseline in units of ``max_bytes``. Variants, interleaved over rounds:

* ``maps``: the backend as shipped (buffers of 64 KiB and more are memory maps, recycled
  by exact size or resized with ``mremap``);
* ``heap``: the same backend with every buffer from torch's allocator (the C heap),
  recycled by exact size only: how the backend held memory before (the baseline).

Mixes: ``mixed`` (0 B to 16 MiB: 15% 0-byte, 15% 1-byte, small, medium, large),
``tail`` (80% 4 MiB chunks, 20% shorter last chunks of a random size), ``uniform``
(4 MiB only: vLLM's chunks). Medians over the rounds, with the range beside them.

Run: .venv/bin/python benchmarks/bench_cpu_storm.py [rounds]
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

MiB = 1 << 20
MIXES = ("mixed", "tail", "uniform")
VARIANTS = ("heap", "maps")


def _size(rng: random.Random, mix: str) -> int:
    r = rng.random()
    if mix == "uniform":
        return 4 * MiB
    if mix == "tail":
        return 4 * MiB if r < 0.8 else rng.randint(1, 4 * MiB)
    if r < 0.15:
        return 0
    if r < 0.30:
        return 1
    if r < 0.55:
        return rng.randint(2, 4096)
    lo, hi = (4096, MiB) if r < 0.85 else (MiB, 16 * MiB)
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _run(
    variant: str, mix: str, puts: int = 2000, max_bytes: int = 256 * MiB
) -> dict[str, float]:
    import torch

    from lmcache_core import CPUBackend
    from lmcache_core.testing import make_key

    rng = random.Random(0)
    src = torch.randint(0, 256, (16 * MiB,), dtype=torch.uint8)
    keys = [make_key(f"k{i}") for i in range(5000)]

    async def backend(limit: int) -> CPUBackend:
        b = CPUBackend({"max_bytes": limit})
        await b.start()
        if variant == "heap":
            b._pool.map_min = 1 << 62  # every buffer from torch's allocator
        return b

    warm = await backend(32 * MiB)
    for i in range(100):
        await warm.put(keys[i], src[: _size(rng, mix)])
    await warm.close()
    del warm
    gc.collect()
    base = peak = _rss()
    b = await backend(max_bytes)
    t0 = time.perf_counter()
    for i in range(puts):
        await b.put(keys[rng.randrange(len(keys))], src[: _size(rng, mix)])
        if i % 50 == 0:
            peak = max(peak, _rss())
    elapsed = time.perf_counter() - t0
    peak = max(peak, _rss())
    return {"us_per_put": elapsed / puts * 1e6, "growth_x": (peak - base) / max_bytes}


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(rounds):
        for mix in MIXES:
            for variant in VARIANTS:
                out = subprocess.run(
                    [sys.executable, __file__, "--one", variant, mix],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                results.setdefault((mix, variant), []).append(json.loads(out.stdout))
    print(f"256 MiB cpu tier, 2,000 puts per run, medians of {rounds} interleaved runs")
    print("mix       variant   us/put (range)          RSS growth x max_bytes (range)")
    for mix in MIXES:
        for variant in VARIANTS:
            runs = results[(mix, variant)]
            us = [r["us_per_put"] for r in runs]
            gx = [r["growth_x"] for r in runs]
            print(
                f"{mix:9s} {variant:8s} {statistics.median(us):7.0f} ({min(us):.0f}-{max(us):.0f})"
                f"         {statistics.median(gx):5.2f} ({min(gx):.2f}-{max(gx):.2f})"
            )
        heap = statistics.median(r["us_per_put"] for r in results[(mix, "heap")])
        maps = statistics.median(r["us_per_put"] for r in results[(mix, "maps")])
        print(f"{mix:9s} maps time / heap time = {maps / heap:.2f}x")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(asyncio.run(_run(sys.argv[2], sys.argv[3]))))
    else:
        main()
