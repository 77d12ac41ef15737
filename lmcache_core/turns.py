"""A storage device's read queue: at most ``n`` reads on it at once, from any number of threads.

A tier that reads many objects at once from a pool of threads gets its best throughput
with only a few requests on the device (``docs/performance.md``, "Reads a few at a
time"): each reader checksums and copies its object while the next ones are on the
device. :class:`ReadTurns` keeps that number. Where the optional compiled module was
built (``lmcache_core._speedups.turns_preadv``) the reads are issued by at most ``n``
reader threads of the queue itself: a reader thread whose read completes issues the
next queued one at once, so the device never waits for a sleeping thread to be woken
and scheduled; the caller waits with the GIL released and is woken to checksum and
copy its data, off the device's path ("A read queue with its own threads"). The
fallback is a :class:`threading.BoundedSemaphore` around :func:`os.preadv`: the same
results, each hand-over of a turn waiting for the next caller to be scheduled and to
get the GIL.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

try:  # the compiled queue (setup.py); None: a semaphore in Python
    from . import _speedups as _native
except ImportError:  # pragma: no cover - exercised by builds without a C compiler
    _native = None  # type: ignore[assignment]

__all__ = ["QUEUE_ENV", "ReadTurns"]

#: ``python`` makes every :class:`ReadTurns` use the Python semaphore even where the
#: compiled queue was built (the A/B of the benchmarks; any other value: the default).
QUEUE_ENV = "LMCACHE_CORE_READ_QUEUE"


class ReadTurns:
    """At most ``n`` :meth:`preadv` calls through this object are on the device at once.

    ``native=False`` (or the environment variable ``LMCACHE_CORE_READ_QUEUE=python``)
    forces the Python semaphore (tests, and the A/B in the docs);
    ``idle_s``: how long the compiled queue's reader threads wait for work before they
    exit (started again by the next read)."""

    def __init__(self, n: int, *, native: bool = True, idle_s: float = 2.0) -> None:
        if n < 1:
            raise ValueError(f"ReadTurns needs n >= 1, got {n}")
        self.n = n
        use_native = native and _native is not None and os.environ.get(QUEUE_ENV) != "python"
        self._queue: object | None = (
            _native.turns_new(n, max(1, round(idle_s * 1000))) if use_native else None
        )
        self._sem = threading.BoundedSemaphore(n)
        self._lock = threading.Lock()
        self._reading = 0
        self._reads = 0

    @property
    def native(self) -> bool:
        """Whether the compiled read queue is used (else the Python semaphore)."""
        return self._queue is not None

    def preadv(self, fd: int, buffers: Sequence[Any], offset: int) -> int:
        """:func:`os.preadv` of the writable ``buffers`` at ``offset``; bytes read (``0``
        for no buffers). Raises :class:`ValueError` for a negative offset, and what
        :func:`os.preadv` raises otherwise (``OSError``, ``BufferError`` for a read-only
        buffer, ``TypeError``)."""
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        if len(buffers) == 0:
            return 0
        if self._queue is not None:
            return _native.turns_preadv(self._queue, fd, buffers, offset)
        with self._sem:
            with self._lock:
                self._reading += 1
            try:
                return os.preadv(fd, buffers, offset)
            finally:
                with self._lock:
                    self._reading -= 1
                    self._reads += 1

    def stats(self) -> dict[str, int | bool]:
        """``native``, ``n``, ``threads`` (the queue's reader threads now), ``queued``,
        ``reading`` (reads on the device now) and ``reads`` (completed)."""
        if self._queue is not None:
            n, threads, queued, reading, reads = _native.turns_stats(self._queue)
            return {
                "native": True,
                "n": n,
                "threads": threads,
                "queued": queued,
                "reading": reading,
                "reads": reads,
            }
        with self._lock:
            return {
                "native": False,
                "n": self.n,
                "threads": 0,
                "queued": 0,
                "reading": self._reading,
                "reads": self._reads,
            }
