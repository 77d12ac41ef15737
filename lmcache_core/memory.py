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

__all__ = ["as_bytes", "copy_into", "pinned_available", "staging_empty"]

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
    if dst.device.type == "cpu" and src.device.type == "cpu":
        n = dst.numel() * dst.element_size()
        if n != src.numel() * src.element_size():
            raise ValueError(
                f"copy of {src.numel() * src.element_size()} bytes into a {n}-byte buffer"
            )
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("copy_into needs contiguous tensors")
        if n:
            _memmove(dst.data_ptr(), src.data_ptr(), n)
        return
    as_bytes(dst).copy_(as_bytes(src), non_blocking=False)


def pinned_available() -> bool:
    """Whether page-locked host memory can be allocated (CUDA present; CPU-only torch
    raises on ``pin_memory=True``)."""
    return bool(torch.cuda.is_available())


def staging_empty(
    shape: tuple[int, ...], dtype: torch.dtype, pin: bool | None = None
) -> torch.Tensor:
    """A host staging buffer: page-locked when ``pin`` (default: when CUDA is available),
    so device copies from and into it can run asynchronously on a side stream."""
    if pin is None:
        pin = pinned_available()
    return torch.empty(shape, dtype=dtype, pin_memory=pin)
