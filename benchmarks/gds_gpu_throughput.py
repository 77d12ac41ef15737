"""gds tier on a GPU machine: device tensor -> file -> device tensor (bit-exact), GB/s,
next to what the same bytes cost without the tier: a device-to-host copy plus a host
O_DIRECT file write, and a cold host O_DIRECT read plus a host-to-device copy, with
``--raw-threads`` files in flight (the baseline is run twice per repeat: its A/A).

Needs CUDA (``tools/gpu_check.sh`` runs it); prints the I/O path kvikio gave (``gds`` =
GPUDirect Storage, ``compat`` = compatibility mode, ``posix`` = the backend's fallback).
``--device cpu`` runs the same steps on host tensors (the script's rehearsal on a machine
without CUDA: ``GPU_CHECK_REHEARSAL=1 tools/gpu_check.sh``). Not part of ``make bench``.

Run: python benchmarks/gds_gpu_throughput.py [--dir DIR] [--chunk-mib 16] [--total-mib 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from _storage import files_under, make_cold
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
    p.add_argument("--raw-threads", type=int, default=4, help="baseline files in flight")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu for a rehearsal")
    p.add_argument("--force-posix", action="store_true")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("gds_gpu_throughput: no CUDA device; nothing measured")
        return 0
    device = torch.device(args.device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    nbytes, n = args.chunk_mib * MiB, max(4, args.total_mib // args.chunk_mib)
    work = tempfile.mkdtemp(prefix="gds-gpu-", dir=args.dir)
    tier_dir = os.path.join(work, "tier")
    dev = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device) for _ in range(n)]
    outs = [torch.empty_like(d) for d in dev]
    host = [aligned_empty((nbytes,), torch.uint8) for _ in range(n)]
    names = ("tier_w", "base_w", "base_w2", "tier_r", "base_r", "base_r2")
    samples: dict[str, list[float]] = {k: [] for k in names}
    pool = concurrent.futures.ThreadPoolExecutor(args.raw_threads)

    def cold(top: str) -> None:
        make_cold(files_under(top, nbytes))  # objects only (not the open index's files)

    def raw_write(i: int) -> None:  # D2H copy + host O_DIRECT write + fsync of a new file
        host[i].copy_(dev[i])
        name = os.path.join(work, f"raw{i}")
        if os.path.exists(name):
            os.unlink(name)  # a new file each time, as the tier writes
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | O_DIRECT, 0o600)
        try:
            assert os.pwrite(fd, memoryview(host[i].numpy().data), 0) == nbytes
            os.fsync(fd)
        finally:
            os.close(fd)

    def raw_read(i: int) -> None:  # cold host O_DIRECT read + H2D copy of one file
        fd = os.open(os.path.join(work, f"raw{i}"), os.O_RDONLY | O_DIRECT)
        try:
            assert os.preadv(fd, [memoryview(host[i].numpy().data)], 0) == nbytes
        finally:
            os.close(fd)
        outs[i].copy_(host[i])

    def timed_raw(fn: Callable[[int], None], name: str) -> None:
        t0 = time.perf_counter()
        list(pool.map(fn, range(n)))
        sync()
        samples[name].append(time.perf_counter() - t0)

    async def run() -> str:
        b = GdsBackend({"path": tier_dir, "max_bytes": 4 * n * (nbytes + 8192),
                        "force_posix": args.force_posix})  # fmt: skip
        await b.start()
        try:
            for r in range(args.repeats):
                keys = [CacheEngineKey("gpu-bench", 1, 0, (r << 20) + i + 1, "uint8")
                        for i in range(n)]  # fmt: skip
                sync()
                t0 = time.perf_counter()
                assert all(await b.batched_put(keys, dev))
                samples["tier_w"].append(time.perf_counter() - t0)
                timed_raw(raw_write, "base_w")
                timed_raw(raw_write, "base_w2")
                cold(tier_dir)
                t0 = time.perf_counter()
                assert all(await b.batched_get_into(keys, outs))
                sync()
                samples["tier_r"].append(time.perf_counter() - t0)
                for d, o in zip(dev, outs, strict=True):
                    assert torch.equal(d, o), "device round trip is not bit-exact"
                for name in ("base_r", "base_r2"):
                    cold(work)
                    timed_raw(raw_read, name)
                for d, o in zip(dev, outs, strict=True):
                    assert torch.equal(d, o), "the baseline's round trip is not bit-exact"
                for o in outs:
                    o.zero_()
                await asyncio.gather(*(b.remove(k) for k in keys))
            st = b.stats()
            return f"{st['io_path']} ({st['io_path_reason']})"
        finally:
            await b.close()

    try:
        path = asyncio.run(run())
    finally:
        pool.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    gb = n * nbytes / 1e9
    g = {k: gb / statistics.median(v) for k, v in samples.items()}
    aa_w = max(g["base_w"], g["base_w2"]) / min(g["base_w"], g["base_w2"])
    aa_r = max(g["base_r"], g["base_r2"]) / min(g["base_r"], g["base_r2"])
    print(f"gds I/O path: {path}; {n} x {args.chunk_mib} MiB on {device}, median of "
          f"{args.repeats}, baseline {args.raw_threads} files in flight")  # fmt: skip
    print(f"  write: tier {g['tier_w']:.2f} GB/s | D2H copy + host O_DIRECT write "
          f"{g['base_w']:.2f} GB/s = {g['tier_w'] / g['base_w']:.2f}x (A/A {aa_w:.2f})")  # fmt: skip
    print(f"  cold read: tier {g['tier_r']:.2f} GB/s | host O_DIRECT read + H2D copy "
          f"{g['base_r']:.2f} GB/s = {g['tier_r'] / g['base_r']:.2f}x (A/A {aa_r:.2f}), "
          "bit-exact")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
