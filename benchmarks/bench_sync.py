"""Per-call cost of SyncBackend's small operations, from a plain thread.

For each operation, three ways in the same run, interleaved in rounds (``--rounds``
rounds of ``--block`` calls each):

* ``sync``: the ``SyncBackend`` method called from a plain thread (as vLLM's scheduler and
  worker threads call it): the backend's thread-safe fast path when it has one;
* ``loop``: the same operation awaited on the backend's own event loop, timed inside the
  loop (no thread hop at all): the work itself;
* ``hop``: ``io.run(backend.op(...))`` from the plain thread, the round trip every call
  paid before the fast paths.

The per-call overhead is ``sync - loop`` (medians); the A/A spread is that of ``sync``
measured twice under two names. Backends: the ``cpu`` backend, and a hierarchy of one
``cpu`` tier (the lookups and leases are the hierarchy's).

Run: .venv/bin/python benchmarks/bench_sync.py [--rounds 21] [--block 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _util import aa_spread

from lmcache_core import CacheEngineKey, CPUBackend, SyncBackend, TieredHierarchy


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("bench-sync", 1, 0, (i + 1) * 0x9E3779B97F4A7C15 % (1 << 128), "bf16")


def measure(
    sb: SyncBackend,
    sync_fn: Callable[[], Any],
    loop_fn: Callable[[], Awaitable[Any]],
    hop_fn: Callable[[], Any],
    rounds: int,
    block: int,
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"sync A": [], "sync B": [], "loop": [], "hop": []}
    clock = time.perf_counter

    def in_thread(name: str, fn: Callable[[], Any]) -> None:
        def body() -> None:
            out = samples[name]
            for _ in range(block):
                t0 = clock()
                fn()
                out.append(clock() - t0)

        th = threading.Thread(target=body)
        th.start()
        th.join()

    async def on_loop() -> None:
        out = samples["loop"]
        for _ in range(block):
            t0 = clock()
            await loop_fn()
            out.append(clock() - t0)

    for _ in range(2):  # warm-up
        sync_fn()
        hop_fn()
    for _ in range(rounds):
        in_thread("sync A", sync_fn)
        sb.io.run(on_loop())
        in_thread("hop", hop_fn)
        in_thread("sync B", sync_fn)
    return samples


def report(name: str, s: dict[str, list[float]]) -> None:
    sync = statistics.median(s["sync A"] + s["sync B"]) * 1e6
    loop = statistics.median(s["loop"]) * 1e6
    hop = statistics.median(s["hop"]) * 1e6
    print(
        f"{name:52s} sync {sync:8.1f} us (A/A {aa_spread(s['sync A'], s['sync B']):.2f}) | "
        f"on its loop {loop:8.1f} us | overhead {sync - loop:7.1f} us | "
        f"old hop {hop:8.1f} us = {hop / sync:5.1f}x sync"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--block", type=int, default=50)
    args = ap.parse_args()
    r, b = args.rounds, args.block
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    keys = [key(i) for i in range(128)]
    small = torch.zeros(16, dtype=torch.uint8)
    kib = torch.zeros(1024, dtype=torch.uint8)

    cpu = CPUBackend({"max_bytes": "64MiB"})
    sb = SyncBackend(cpu)
    sb.start()
    for k in keys:
        sb.put(k, small)
    k0 = keys[7]
    report("cpu: contains, one key", measure(
        sb, lambda: sb.contains(k0), lambda: cpu.contains(k0),
        lambda: sb.io.run(cpu.contains(k0)), r, b))  # fmt: skip
    report("cpu: batched_contains, 128 keys", measure(
        sb, lambda: sb.batched_contains(keys), lambda: cpu.batched_contains(keys),
        lambda: sb.io.run(cpu.batched_contains(keys)), r, b))  # fmt: skip
    report("cpu: put 1 KiB (overwrite)", measure(
        sb, lambda: sb.put(k0, kib), lambda: cpu.put(k0, kib),
        lambda: sb.io.run(cpu.put(k0, kib)), r, b))  # fmt: skip
    sb.close()

    h = TieredHierarchy.from_config(
        {"tiers": [{"name": "cpu", "backend": "cpu", "options": {"max_bytes": "64MiB"}}]}
    )
    hs = SyncBackend(h)
    hs.start()
    for k in keys:
        hs.put(k, small)

    async def lease_loop(ks: list[CacheEngineKey]) -> None:
        await h.lookup_prefix(ks, lease_s=30)
        await h.release(ks)

    def lease_sync(ks: list[CacheEngineKey]) -> None:
        hs.lookup_prefix(ks, lease_s=30)
        hs.release(ks)

    def lease_hop(ks: list[CacheEngineKey]) -> None:
        hs.io.run(h.lookup_prefix(ks, lease_s=30))
        hs.io.run(h.release(ks))

    one = keys[:1]
    report("hierarchy: contains, one key", measure(
        hs, lambda: hs.contains(k0), lambda: h.contains(k0),
        lambda: hs.io.run(h.contains(k0)), r, b))  # fmt: skip
    report("hierarchy: lookup_prefix, one key", measure(
        hs, lambda: hs.lookup_prefix(one), lambda: h.lookup_prefix(one),
        lambda: hs.io.run(h.lookup_prefix(one)), r, b))  # fmt: skip
    report("hierarchy: lookup_prefix + lease + release, one key", measure(
        hs, lambda: lease_sync(one), lambda: lease_loop(one), lambda: lease_hop(one),
        r, b))  # fmt: skip
    report("hierarchy: lookup_prefix, 128 keys", measure(
        hs, lambda: hs.lookup_prefix(keys), lambda: h.lookup_prefix(keys),
        lambda: hs.io.run(h.lookup_prefix(keys)), r, b // 5))  # fmt: skip
    report("hierarchy: lookup_prefix + lease + release, 128 keys", measure(
        hs, lambda: lease_sync(keys), lambda: lease_loop(keys), lambda: lease_hop(keys),
        r, b // 5))  # fmt: skip
    report("hierarchy: batched_contains, 128 keys", measure(
        hs, lambda: hs.batched_contains(keys), lambda: h.batched_contains(keys),
        lambda: hs.io.run(h.batched_contains(keys)), r, b // 5))  # fmt: skip
    report("hierarchy: put 1 KiB (overwrite)", measure(
        hs, lambda: hs.put(k0, kib), lambda: h.put(k0, kib),
        lambda: hs.io.run(h.put(k0, kib)), r, b))  # fmt: skip
    st = h.stats()
    assert st["threadsafe_lookups"] > 0 and st["leases"] == 0
    hs.close()
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
