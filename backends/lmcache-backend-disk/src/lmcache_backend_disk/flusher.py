"""Flushes issued together: a batch's ``fdatasync``/``fsync`` calls run at the same time.

A flush of a file or a directory waits for a journal commit and a device cache flush. One
after another, each waits for its own round trip (measured here: 16 directory fsyncs in
a row took 23-100 ms, longer than writing the 16 objects); issued together, they join
the same journal commit, like the raw baseline's fsyncs with several in flight.
:meth:`Flusher.sync_fds` issues a whole wave at once from plain threads of the compiled
helper (:func:`lmcache_core.flushes.sync_fds`) where it was built, else from this
flusher's Python threads (blocking system calls that release the GIL).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from lmcache_core import flushes

__all__ = ["Flusher"]

T = TypeVar("T")

#: Most flushes in flight at once (the raw baseline's deepest setting).
MAX_IN_FLIGHT = 16


class Flusher:
    """Runs blocking flush calls of one batch concurrently (thread-safe).

    Its threads start on first use and stop at :meth:`close`; after that every call runs
    in the caller's thread, one after another (same results, just slower)."""

    def __init__(self, name: str, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.name = name
        self.max_in_flight = max_in_flight
        self._exec: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor | None:
        with self._lock:
            if self._closed:
                return None
            if self._exec is None:
                self._exec = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.max_in_flight, thread_name_prefix=f"{self.name}-flush"
                )
            return self._exec

    def run_all(self, fn: Callable[[T], object], items: Sequence[T]) -> list[BaseException | None]:
        """Call ``fn(item)`` for every item, concurrently; returns, per item, the exception
        it raised or ``None``. The first item runs in the calling thread."""
        errors: list[BaseException | None] = [None] * len(items)
        if not items:
            return errors
        ex = self._executor() if len(items) > 1 else None
        futs: list[tuple[int, concurrent.futures.Future[object]]] = []
        inline = [0]
        for i in range(1, len(items)):
            if ex is None:
                inline.append(i)
                continue
            try:
                futs.append((i, ex.submit(fn, items[i])))
            except RuntimeError:  # shut down meanwhile: run it here
                inline.append(i)
        for i in inline:
            try:
                fn(items[i])
            except BaseException as exc:  # reported per item, like the pool's
                errors[i] = exc
        for i, fut in futs:
            errors[i] = fut.exception()
        return errors

    def sync_fds(self, fds: Sequence[int], datasync: Sequence[bool]) -> list[OSError | None]:
        """``fdatasync(fds[i])`` where ``datasync[i]``, else ``fsync(fds[i])``, all issued
        together; per descriptor the ``OSError`` its call raised or ``None``."""
        native = flushes.sync_fds(fds, datasync)
        if native is not None:
            return native

        def one(i: int) -> None:
            (os.fdatasync if datasync[i] else os.fsync)(fds[i])

        out: list[OSError | None] = []
        for err in self.run_all(one, range(len(fds))):
            if err is not None and not isinstance(err, OSError):
                raise err
            out.append(err)
        return out

    def close(self) -> None:
        """Stop the threads (waiting for flushes in progress)."""
        with self._lock:
            self._closed = True
            ex, self._exec = self._exec, None
        if ex is not None:
            ex.shutdown(wait=True)
