"""Page-aligned memory for ``O_DIRECT`` I/O: reusable staging buffers and aligned tensors.

``O_DIRECT`` transfers need the memory address, the file offset and the length aligned
(here to 4096 bytes, which satisfies every device's logical block size). Tensors from
``torch.empty`` are only 64-byte aligned, so writes go through a staging buffer and reads
land directly in the caller's tensor only when it is aligned (see :func:`aligned_empty`).
Staging buffers are anonymous ``mmap`` regions, reused so the hot path never page-faults.
"""

from __future__ import annotations

import mmap
import os
import threading

import torch

__all__ = [
    "ALIGN",
    "AlignedBuffer",
    "BufferPool",
    "aligned_empty",
    "is_aligned",
    "probe_direct_io",
    "round_up",
]

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def is_aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s data starts on an ``ALIGN`` boundary."""
    return t.data_ptr() % ALIGN == 0


def aligned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor whose data is 4096-byte aligned.

    ``get_into`` reads straight into such a tensor with ``O_DIRECT`` (no staging copy).
    """
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % ALIGN
    flat = raw[offset : offset + nbytes]
    if dtype == torch.uint8:
        return flat.view(tuple(shape))
    return flat.view(dtype).view(tuple(shape))


class AlignedBuffer:
    """A page-aligned anonymous mapping with a uint8 tensor and a memoryview over it."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, max(nbytes, ALIGN))
        self.view = memoryview(self._map)[:nbytes]
        self.tensor = (
            torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes)
            if nbytes
            else (torch.empty(0, dtype=torch.uint8))
        )

    def close(self) -> None:
        self.view.release()
        del self.tensor
        try:
            self._map.close()
        except BufferError:  # a tensor view is still alive somewhere; the GC will unmap
            pass


class BufferPool:
    """Reusable :class:`AlignedBuffer` objects, by size, holding at most ``max_bytes`` idle."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._idle = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> AlignedBuffer:
        """A buffer of at least ``nbytes`` (rounded up to ``ALIGN``)."""
        size = round_up(max(nbytes, 1))
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                self._idle -= size
                return bucket.pop()
        return AlignedBuffer(size)

    def give(self, buf: AlignedBuffer) -> None:
        """Return a buffer for reuse (dropped when the pool is full)."""
        with self._lock:
            while self._idle + buf.nbytes > self.max_bytes and self._free:
                size = next(iter(self._free))
                victim = self._free[size].pop()
                if not self._free[size]:
                    del self._free[size]
                self._idle -= size
                victim.close()
            if self._idle + buf.nbytes <= self.max_bytes:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._idle += buf.nbytes
                return
        buf.close()

    def clear(self) -> None:
        with self._lock:
            for bucket in self._free.values():
                for buf in bucket:
                    buf.close()
            self._free.clear()
            self._idle = 0


def probe_direct_io(directory: str, name: str) -> bool:
    """Whether files in ``directory`` accept ``O_DIRECT`` writes and reads of aligned blocks."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    path = os.path.join(directory, name)
    buf = AlignedBuffer(ALIGN)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flag, 0o600)
    except OSError:
        buf.close()
        return False
    try:
        buf.view[:] = b"\x5a" * ALIGN
        if os.pwrite(fd, buf.view, 0) != ALIGN:
            return False
        buf.view[:] = b"\0" * ALIGN
        return os.preadv(fd, [buf.view], 0) == ALIGN and bytes(buf.view[:4]) == b"\x5a" * 4
    except OSError:
        return False
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        buf.close()
