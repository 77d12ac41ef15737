"""Host-copy primitives behind the cpu backend and the token database, measured here.

Prints medians (same run, round-robin blocks) for:
* a 4 MiB copy with ``torch.Tensor.copy_`` (OpenMP threads) and with one ``memmove``
  (``lmcache_core.memory.copy_into``), on an idle machine and while another process
  runs float32 matmuls on 2 torch threads (as vLLM's forward pass does in a worker);
* per-call overhead of a 1 KiB copy: ``copy_into`` (ctypes memmove) vs ``numpy.copyto``
  on fresh views;
* packing 32k Python ints as int32: module-level ``struct.pack`` vs a compiled ``Struct``.

Run: .venv/bin/python benchmarks/bench_copy.py
"""

from __future__ import annotations

import multiprocessing as mp
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _util import interleaved

from lmcache_core.memory import copy_into

MiB = 1 << 20


def _compute(stop_at: float) -> None:
    """Stand-in for vLLM's forward pass: float32 matmuls on torch's OpenMP threads."""
    torch.set_num_threads(2)
    a = torch.randn(1024, 1024)
    while time.time() < stop_at:
        a @ a


def copies(label: str) -> None:
    src = torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    t = interleaved(
        {"torch": lambda: dst.copy_(src), "memmove": lambda: copy_into(dst, src)}, repeat=60
    )
    print(
        f"4 MiB copy, {label:28s} torch copy_ {t['torch'] * 1e3:7.3f} ms   "
        f"memmove {t['memmove'] * 1e3:7.3f} ms"
    )


def main() -> None:
    copies("idle:")
    proc = mp.get_context("spawn").Process(target=_compute, args=(time.time() + 30,))
    proc.start()
    time.sleep(2.0)
    copies("2-thread matmuls running:")
    proc.terminate()
    proc.join()

    a = torch.empty(1024, dtype=torch.uint8)
    b = torch.empty_like(a)
    t = interleaved(
        {
            "copy_into": lambda: copy_into(b, a),
            "numpy": lambda: np.copyto(b.numpy(), a.numpy()),
        },
        repeat=2000,
    )
    print(
        f"1 KiB copy overhead: copy_into {t['copy_into'] * 1e6:.1f} us, "
        f"numpy.copyto on fresh views {t['numpy'] * 1e6:.1f} us"
    )

    ints = list(range(32768))
    packer = struct.Struct("<32768i").pack
    t = interleaved(
        {"module": lambda: struct.pack("<32768i", *ints), "compiled": lambda: packer(*ints)},
        repeat=60,
    )
    print(
        f"32k ints -> int32: struct.pack {t['module'] * 1e6:.0f} us, "
        f"compiled Struct.pack {t['compiled'] * 1e6:.0f} us"
    )


if __name__ == "__main__":
    main()
