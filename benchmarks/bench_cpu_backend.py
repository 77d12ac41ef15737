"""cpu backend: put + get_into against plain copies of the same bytes.

For 4, 16 and 64 MiB tensors, measured in the same run (round-robin blocks, medians):
* backend: ``await put(key, src)`` then ``await get_into(key, dst)`` (same key, so the
  backend recycles its buffer, as in steady state);
* baselines: two plain copies into reused buffers, with ``torch.Tensor.copy_`` (which
  splits a big copy over torch's OpenMP threads, both cores here) and with a
  single-threaded ``numpy.copyto`` (one ``memcpy``, what the backend does: see
  docs/backends/cpu.md for why). A ratio is baseline time / backend time.

Run: .venv/bin/python benchmarks/bench_cpu_backend.py
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import torch

from lmcache_core import CPUBackend
from lmcache_core.testing import make_key

MiB = 1 << 20
OPTS: dict[str, object] = {}


async def measure(backend: CPUBackend, mb: int) -> None:
    """Print one row: put + get_into of ``mb`` MiB against two plain copies."""
    n = mb * MiB
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    mid = torch.empty_like(src)
    key = make_key(f"bench{mb}")
    s_np, d_np, m_np = src.numpy(), dst.numpy(), mid.numpy()

    async def via_backend() -> None:
        await backend.put(key, src)
        await backend.get_into(key, dst)

    def torch_copies() -> None:
        mid.copy_(src)
        dst.copy_(mid)

    def numpy_copies() -> None:
        np.copyto(m_np, s_np)
        np.copyto(d_np, m_np)

    samples: dict[str, list[float]] = {"backend": [], "torch": [], "numpy": []}
    for _ in range(3):  # warm-up
        await via_backend()
        torch_copies()
        numpy_copies()
    rounds = 12 if mb < 64 else 6
    for _ in range(rounds):
        for _ in range(5):
            t0 = time.perf_counter()
            await via_backend()
            samples["backend"].append(time.perf_counter() - t0)
        for _ in range(5):
            t0 = time.perf_counter()
            torch_copies()
            samples["torch"].append(time.perf_counter() - t0)
        for _ in range(5):
            t0 = time.perf_counter()
            numpy_copies()
            samples["numpy"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in samples.items()}
    assert torch.equal(dst, src)
    print(
        f"{mb:3d} MiB  {med['backend'] * 1e3:7.3f} ms  {med['torch'] * 1e3:9.3f} ms  "
        f"{med['numpy'] * 1e3:11.3f} ms     {med['torch'] / med['backend']:5.2f}x        "
        f"{med['numpy'] / med['backend']:5.2f}x"
    )


async def main() -> None:
    backend = CPUBackend({"max_bytes": "512MiB", **OPTS})
    await backend.start()
    print(
        "size     backend   torch 2x copy_   numpy 2x copyto   vs torch copy_  vs 1-thread memcpy"
    )
    for mb in (4, 16, 64):
        await measure(backend, mb)
    await backend.close()


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) > 1:  # e.g. '{"inline_copy_bytes": "64MiB"}'
        OPTS.update(json.loads(sys.argv[1]))
    asyncio.run(main())
