"""Flushes issued at once: ``fsync``/``fdatasync`` of many descriptors together.

A batch of durable writes ends with a flush of every file and an fsync of every
directory it changed. Issued together they join one journal commit and share device
cache flushes. Issued from Python threads they arrive spread out (each thread must be
scheduled and get the GIL first), and on ext4 every call that arrives after the commit
it needed asks the device for a cache flush of its own (docs/performance.md, "Flushes
issued at once"). :func:`sync_fds` makes all the calls from plain threads of the
optional compiled module (``lmcache_core._speedups.sync_fds``) with the GIL released;
it returns ``None`` where that module was not built, or with
``LMCACHE_CORE_FLUSHES=python``, and the caller uses its own threads.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

try:  # the compiled helper (setup.py); None: the caller's threads
    from . import _speedups as _native
except ImportError:  # pragma: no cover - exercised by builds without a C compiler
    _native = None  # type: ignore[assignment]

__all__ = ["FLUSHES_ENV", "native", "sync_fds"]

#: ``python`` turns :func:`sync_fds` off where the compiled helper was built (the A/B
#: of the benchmarks; any other value: the default).
FLUSHES_ENV = "LMCACHE_CORE_FLUSHES"


def native() -> bool:
    """Whether :func:`sync_fds` makes the calls (else it returns ``None``)."""
    return (
        _native is not None
        and hasattr(_native, "sync_fds")
        and os.environ.get(FLUSHES_ENV) != "python"
    )


def sync_fds(fds: Sequence[int], datasync: Sequence[bool]) -> list[OSError | None] | None:
    """``fdatasync(fds[i])`` where ``datasync[i]``, else ``fsync(fds[i])``, all at once;
    per descriptor the ``OSError`` its call raised or ``None``. ``None`` instead of a
    list: the compiled helper is not available here (the caller makes the calls)."""
    if len(fds) != len(datasync):
        raise ValueError("sync_fds: fds and datasync differ in length")
    if not native():
        return None
    if not fds:
        return []
    errs = _native.sync_fds(list(fds), [bool(d) for d in datasync])
    return [None if e == 0 else OSError(e, os.strerror(e)) for e in errs]
