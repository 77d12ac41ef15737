"""lmcache-backend-disk: a persistent local tier for lmcache-core (backend name ``disk``).

One file per chunk in the lmcache-core object format under a sharded directory tree;
atomic, checksummed, shared by every process that opens the same directory, and bounded
per directory through a shared SQLite index. See ``docs/backends/disk.md``.

Importing this package is cheap: :class:`DiskBackend` and :class:`DiskOptions` are
imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["DiskBackend", "DiskOptions", "DiskTierError", "__version__", "aligned_empty"]

if TYPE_CHECKING:
    from .aligned import aligned_empty
    from .backend import DiskBackend, DiskTierError
    from .options import DiskOptions


def __getattr__(name: str) -> Any:
    if name == "DiskBackend":
        from .backend import DiskBackend

        return DiskBackend
    if name == "DiskTierError":
        from .backend import DiskTierError

        return DiskTierError
    if name == "DiskOptions":
        from .options import DiskOptions

        return DiskOptions
    if name == "aligned_empty":
        from .aligned import aligned_empty

        return aligned_empty
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
