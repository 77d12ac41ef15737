"""gds tier on a GPU machine: device tensor -> file -> device tensor (bit-exact), GB/s,
next to what the same bytes cost without the tier: a device-to-host copy plus a host
O_DIRECT file write (and a cold host read plus a host-to-device copy).

Needs CUDA (``tools/gpu_check.sh`` runs it); prints the I/O path kvikio gave (``gds`` =
GPUDirect Storage, ``compat`` = compatibility mode, ``posix`` = the backend's fallback).
Not part of ``make bench`` (no GPU there).

Run: python benchmarks/gds_gpu_throughput.py [--dir DIR] [--chunk-mib 16] [--total-mib 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from bench_disk import drop_caches
from lmcache_backend_disk import aligned_empty
from lmcache_backend_gds import GdsBackend

from lmcache_core import CacheEngineKey

MiB = 1 << 20
O_DIRECT = getattr(os, "O_DIRECT", 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None)
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--force-posix", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gds_gpu_throughput: no CUDA device; nothing measured")
        return 0
    nbytes, n = args.chunk_mib * MiB, max(4, args.total_mib // args.chunk_mib)
    work = tempfile.mkdtemp(prefix="gds-gpu-", dir=args.dir)
    dev = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda") for _ in range(n)]
    outs = [torch.empty_like(d) for d in dev]
    host = [aligned_empty((nbytes,), torch.uint8) for _ in range(n)]
    samples: dict[str, list[float]] = {k: [] for k in ("tier_w", "base_w", "tier_r", "base_r")}

    async def run() -> str:
        b = GdsBackend({"path": os.path.join(work, "tier"), "max_bytes": 4 * n * (nbytes + 8192),
                        "force_posix": args.force_posix})  # fmt: skip
        await b.start()
        try:
            for r in range(args.repeats):
                keys = [CacheEngineKey("gpu-bench", 1, 0, (r << 20) + i + 1, "uint8")
                        for i in range(n)]  # fmt: skip
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                assert all(await b.batched_put(keys, dev))
                samples["tier_w"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for i in range(n):  # D2H copy + host O_DIRECT write of the same bytes
                    host[i].copy_(dev[i])
                    fd = os.open(os.path.join(work, f"raw{i}"), os.O_WRONLY | os.O_CREAT | O_DIRECT)
                    try:
                        os.pwrite(fd, memoryview(host[i].numpy().data), 0)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                samples["base_w"].append(time.perf_counter() - t0)
                drop_caches([work])
                t0 = time.perf_counter()
                assert all(await b.batched_get_into(keys, outs))
                torch.cuda.synchronize()
                samples["tier_r"].append(time.perf_counter() - t0)
                drop_caches([work])
                t0 = time.perf_counter()
                for i in range(n):  # cold host read + H2D copy
                    fd = os.open(os.path.join(work, f"raw{i}"), os.O_RDONLY | O_DIRECT)
                    try:
                        os.preadv(fd, [memoryview(host[i].numpy().data)], 0)
                    finally:
                        os.close(fd)
                    outs[i].copy_(host[i])
                torch.cuda.synchronize()
                samples["base_r"].append(time.perf_counter() - t0)
                assert all(await b.batched_get_into(keys, outs))
                for d, o in zip(dev, outs, strict=True):
                    assert torch.equal(d, o), "device round trip is not bit-exact"
                await asyncio.gather(*(b.remove(k) for k in keys))
            st = b.stats()
            return f"{st['io_path']} ({st['io_path_reason']})"
        finally:
            await b.close()

    try:
        path = asyncio.run(run())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    gb = n * nbytes / 1e9
    g = {k: gb / statistics.median(v) for k, v in samples.items()}
    print(f"gds I/O path: {path}; {n} x {args.chunk_mib} MiB, median of {args.repeats}")
    print(f"  write: tier {g['tier_w']:.2f} GB/s | D2H copy + host O_DIRECT write "
          f"{g['base_w']:.2f} GB/s = {g['tier_w'] / g['base_w']:.2f}x")  # fmt: skip
    print(f"  cold read: tier {g['tier_r']:.2f} GB/s | host O_DIRECT read + H2D copy "
          f"{g['base_r']:.2f} GB/s = {g['tier_r'] / g['base_r']:.2f}x (bit-exact)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
