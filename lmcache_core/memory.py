"""Byte-level helpers for host memory.

torch's ``copy_`` splits large CPU copies across its OpenMP threads; on a busy machine
(2 cores shared with vLLM's compute threads) one descheduled thread stalls the whole copy:
a 4 MiB copy was seen taking 12 ms with 2 threads under heavy load against 0.2 ms
single-threaded (one uncommitted observation; ``benchmarks/bench_copy.py`` otherwise
shows ``copy_`` ~1.8x faster, so this choice is to be re-measured inside a vLLM worker).
Host-to-host copies here therefore use one ``memmove`` (through ctypes, which releases
the GIL); copies involving a device tensor still go through torch.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["as_bytes", "copy_into"]

_memmove = ctypes.memmove


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (zero copy)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bytes of ``src`` into ``dst`` (same byte size, both contiguous).

    Host to host this is one ``memmove`` through ctypes, which releases the GIL and costs
    a few µs of overhead per call (``benchmarks/bench_copy.py``).
    """
    if dst.is_cpu and src.is_cpu:
        n = dst.nbytes
        if n != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into a {n}-byte buffer")
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("copy_into needs contiguous tensors")
        if n:
            _memmove(dst.data_ptr(), src.data_ptr(), n)
        return
    as_bytes(dst).copy_(as_bytes(src), non_blocking=False)
