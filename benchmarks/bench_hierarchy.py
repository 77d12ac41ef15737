"""Tiered hierarchy benchmarks: prefix lookup and top-tier loads, against bare backends.

1. ``lookup_prefix`` of a 32k-token prompt (128 chunks) over 3 in-process ``cpu`` tiers,
   the chunks spread over the tiers (48 / 48 / 32) so every tier is asked. Baseline: the
   three tiers' own ``batched_contains`` of the same keys, called directly. Also shown:
   the same lookup with leases (pins), and called from a plain thread through the IO loop
   (what vLLM's scheduler does).
2. ``get_into`` of a 4 MiB chunk that is in the top tier, called through ``SyncBackend``
   from a plain thread (as vLLM's worker does). Baseline: the bare ``cpu`` backend's
   ``get_into`` of the same chunk, awaited directly on its event loop (no thread hop at
   all). Two variants: one chunk read again and again (it stays in the CPU caches) and
   16 chunks read in turn (64 MiB, streamed from memory). Also shown: the plain
   ``run_coroutine_threadsafe`` round trip that the thread-safe fast path avoids.

Rounds alternate between the measured path and its baseline; each round's ratio is a
ratio of medians, and the report gives the median ratio over rounds.

    .venv/bin/python benchmarks/bench_hierarchy.py [--rounds 7] [--iters 200]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from lmcache_core import CacheEngineKey, CPUBackend, SyncBackend, TieredHierarchy

MiB = 1 << 20


def median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


async def time_async(fn: Callable[[int], Awaitable[Any]], iters: int) -> list[float]:
    out = []
    for i in range(iters):
        t0 = time.perf_counter()
        await fn(i)
        out.append(time.perf_counter() - t0)
    return out


def time_in_thread(fn: Callable[[int], Any], iters: int) -> list[float]:
    """Time ``fn`` from a fresh plain thread (not the IO loop's)."""
    out: list[float] = []

    def body() -> None:
        for i in range(iters):
            t0 = time.perf_counter()
            fn(i)
            out.append(time.perf_counter() - t0)

    th = threading.Thread(target=body)
    th.start()
    th.join()
    return out


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey(
        "bench-model", 1, 0, (i + 1) * 0x9E3779B97F4A7C15 % (1 << 128), "bfloat16"
    )


def three_tiers(max_bytes: str) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "hot", "backend": "cpu", "options": {"max_bytes": max_bytes}},
            {"name": "warm", "backend": "cpu", "options": {"max_bytes": max_bytes}},
            {"name": "cold", "backend": "cpu", "options": {"max_bytes": max_bytes}},
        ]
    }


def bench_lookup(rounds: int, iters: int) -> dict[str, float]:
    h = TieredHierarchy.from_config(three_tiers("256MiB"))
    sb = SyncBackend(h)
    sb.start()
    keys = [key(i) for i in range(128)]
    small = torch.zeros(16, dtype=torch.uint8)

    async def fill() -> None:
        for i, k in enumerate(keys):
            tier = "hot" if i < 48 else "warm" if i < 96 else "cold"
            await h.tier(tier).backend.put(k, small)

    sb.io.run(fill())
    backends = [t.backend for t in h.tiers]

    async def bare(_: int) -> None:
        for b in backends:
            await b.batched_contains(keys)

    async def lookup(_: int) -> None:
        res = await h.lookup_prefix(keys)
        assert res.num_hit == 128

    async def leased(_: int) -> None:
        res = await h.lookup_prefix(keys, lease_s=60)
        assert res.leased == 128
        await h.release(keys)

    async def measure(fn: Callable[[int], Awaitable[Any]]) -> list[float]:
        return await time_async(fn, iters)

    ratios, hier_us, bare_us, lease_us, thread_us = [], [], [], [], []
    for _ in range(rounds):
        b = median_us(sb.io.run(measure(bare)))
        x = median_us(sb.io.run(measure(lookup)))
        lease_us.append(median_us(sb.io.run(measure(leased))))
        thread_us.append(
            median_us(time_in_thread(lambda i: sb.io.run(h.lookup_prefix(keys)), iters))
        )
        ratios.append(x / b)
        hier_us.append(x)
        bare_us.append(b)
    sb.close()
    return {
        "lookup_us": statistics.median(hier_us),
        "bare_us": statistics.median(bare_us),
        "ratio": statistics.median(ratios),
        "leased_us": statistics.median(lease_us),
        "thread_us": statistics.median(thread_us),
    }


def bench_get_into(rounds: int, iters: int, nchunks: int) -> dict[str, float]:
    nbytes = 4 * MiB
    values = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8).view(torch.bfloat16)
              for _ in range(nchunks)]  # fmt: skip
    keys = [key(1000 + i) for i in range(nchunks)]
    out = torch.empty_like(values[0])

    bare = CPUBackend({"max_bytes": "1GiB"})
    bare_sync = SyncBackend(bare)
    bare_sync.start()
    h = TieredHierarchy.from_config(three_tiers("1GiB"))
    hs = SyncBackend(h)
    hs.start()
    for k, v in zip(keys, values, strict=True):
        assert bare_sync.put(k, v)
        assert hs.put(k, v)
    hs.io.run(h.flush())

    async def bare_get(i: int) -> None:
        assert await bare.get_into(keys[i % nchunks], out)

    async def measure_bare() -> list[float]:
        return await time_async(bare_get, iters)

    def hier_get(i: int) -> None:
        assert hs.get_into(keys[i % nchunks], out)

    def hop_get(i: int) -> None:  # the plain IO-loop round trip, without the fast path
        assert hs.io.run(h.get_into(keys[i % nchunks], out))

    before = h.stats()["threadsafe_hits"]
    ratios, hier_us, bare_us, hop_us = [], [], [], []
    for _ in range(rounds):
        b = median_us(bare_sync.io.run(measure_bare()))
        x = median_us(time_in_thread(hier_get, iters))
        hop_us.append(median_us(time_in_thread(hop_get, iters)))
        ratios.append(x / b)
        hier_us.append(x)
        bare_us.append(b)
    fast_hits = h.stats()["threadsafe_hits"] - before
    assert torch.equal(out.view(torch.uint8), values[(iters - 1) % nchunks].view(torch.uint8))
    hs.close()
    bare_sync.close()
    return {
        "hier_us": statistics.median(hier_us),
        "bare_us": statistics.median(bare_us),
        "ratio": statistics.median(ratios),
        "hop_us": statistics.median(hop_us),
        "hop_ratio": statistics.median(hop_us) / statistics.median(bare_us),
        "fast_hits": fast_hits,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)

    lk = bench_lookup(args.rounds, args.iters)
    print("lookup_prefix, 128 chunks (32k tokens / 256) over 3 cpu tiers (48/48/32):")
    print(f"  hierarchy lookup_prefix        {lk['lookup_us']:8.1f} us   (target <= 1000 us)")
    print(f"  bare batched_contains x3       {lk['bare_us']:8.1f} us")
    print(f"  ratio hierarchy / bare         {lk['ratio']:8.2f}x")
    print(f"  with leases (pin + release)    {lk['leased_us']:8.1f} us")
    print(f"  from a thread via the IO loop  {lk['thread_us']:8.1f} us")
    for n, label in ((1, "one chunk, cache-hot"), (16, "16 chunks in turn, 64 MiB")):
        g = bench_get_into(args.rounds, args.iters, n)
        print(f"get_into of a 4 MiB top-tier hit ({label}):")
        print(f"  hierarchy via SyncBackend, plain thread  {g['hier_us']:8.1f} us")
        print(f"  bare cpu get_into awaited on its loop    {g['bare_us']:8.1f} us")
        print(f"  ratio                                    {g['ratio']:8.3f}x   (target <= 1.1x)")
        print(
            f"  without the fast path (IO-loop hop)      {g['hop_us']:8.1f} us = "
            f"{g['hop_ratio']:.2f}x"
        )
        print(f"  loads served by the thread-safe path     {g['fast_hits']:8d}")


if __name__ == "__main__":
    main()
