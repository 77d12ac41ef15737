"""A worker's bounded pool of reused, chunk-shaped host buffers.

Fresh memory costs page faults (1.5-2.4 GB/s here against ~11 GB/s into reused memory),
so buffers are allocated once, up to a fixed count, and recycled: lazily, or ahead of
use by :meth:`ChunkBuffers.fill` (the connector fills its load buffers from a thread of
its own at start, so a process's first load does not fault its buffers in). They are
page-locked when CUDA is available (device copies then run asynchronously), else
page-aligned mappings, so a disk tier reads into them with ``O_DIRECT`` directly rather
than through a bounce buffer. ``take`` never waits: a caller finding the pool empty
decides what to do (a save is dropped, a background load waits for the next step).
"""

from __future__ import annotations

import threading

import torch

from ...memory import mapped_empty, pinned_available, populated_empty, staging_empty

__all__ = ["MAPPED_MIN_NBYTES", "ChunkBuffers", "buffer_count"]

#: Buffers this large or larger are page-aligned mappings of their own (smaller ones
#: come from ``torch.empty``).
MAPPED_MIN_NBYTES = 1 << 20


def buffer_count(max_bytes: int, chunk_bytes: int, pinned: bool) -> int:
    """How many chunk buffers ``max_bytes`` pays for (at least 4). Page-locked buffers
    come from torch's caching host allocator, which rounds each up to a power of two and
    keeps it: they are charged that (a 5 MiB chunk costs 8 MiB)."""
    charged = 1 << (chunk_bytes - 1).bit_length() if pinned and chunk_bytes > 1 else chunk_bytes
    return max(4, max_bytes // max(1, charged))


class ChunkBuffers:
    """At most ``max_buffers`` buffers of ``shape``/``dtype``; thread-safe."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, max_buffers: int) -> None:
        self.shape = shape
        self.dtype = dtype
        self.max_buffers = max(1, max_buffers)
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of one buffer."""
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._allocated - len(self._free)

    def take(self) -> torch.Tensor | None:
        """A free buffer, or ``None`` when all are in use."""
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._allocated >= self.max_buffers:
                return None
            self._allocated += 1
        try:
            return self._new(populate=False)
        except BaseException:
            with self._lock:
                self._allocated -= 1
            raise

    def _new(self, populate: bool) -> torch.Tensor:
        if pinned_available():
            return staging_empty(self.shape, self.dtype)
        nbytes = self.nbytes
        if nbytes < MAPPED_MIN_NBYTES:  # (a mapping each would waste more than it saves)
            buf = torch.empty(self.shape, dtype=self.dtype)
            if populate:
                buf.zero_()  # (faults its pages in)
            return buf
        # Page-aligned; faulted in here only for fill(): a buffer taken on a hot thread
        # faults on first write, wherever that runs (a load's read thread).
        flat = populated_empty(nbytes) if populate else mapped_empty(nbytes)
        return flat.view(self.dtype).view(self.shape)

    def fill(self, n: int | None = None) -> int:
        """Allocate free buffers (faulted in) until ``n`` (default: all ``max_buffers``)
        exist; returns how many were made. Slow (page faults): call it off hot threads."""
        made = 0
        target = self.max_buffers if n is None else min(n, self.max_buffers)
        while True:
            with self._lock:
                if self._allocated >= target:
                    return made
                self._allocated += 1
            try:
                buf = self._new(populate=True)
            except BaseException:
                with self._lock:
                    self._allocated -= 1
                raise
            self.give(buf)
            made += 1

    def take_many(self, n: int) -> list[torch.Tensor]:
        """Up to ``n`` free buffers."""
        out = []
        for _ in range(n):
            buf = self.take()
            if buf is None:
                break
            out.append(buf)
        return out

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer taken from this pool (nothing may write into it any more)."""
        with self._lock:
            self._free.append(buf)
