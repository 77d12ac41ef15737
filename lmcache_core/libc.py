"""The C library through ctypes, loaded once for the process.

The calls Python's ``os`` does not offer (``madvise`` with ``MADV_POPULATE_WRITE``,
``renameat2``, ``fallocate``, ``statx``, ``syscall`` for ``openat2``) go through one
handle on the symbols already loaded in the process (``dlopen(NULL)``: the C library
among them), with ``errno`` kept after each call for :func:`ctypes.get_errno`.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["libc", "libc_function"]


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The process's handle (``use_errno=True``), made on first use; ``None`` where it
    cannot be loaded."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def libc_function(name: str) -> Any | None:
    """A new foreign function for the C library's ``name``, or ``None`` where the
    library or the symbol is missing. Each call returns its own function object (not
    the handle's shared attribute), so the ``argtypes`` and ``restype`` a caller sets
    never change another caller's."""
    lib = libc()
    if lib is None:
        return None
    try:
        return lib[name]
    except AttributeError:  # not in this C library (older glibc, other systems)
        return None
