"""lmcache-backend-gds: an NVMe tier for lmcache-core (backend name ``gds``) that moves
KV between device memory and files through kvikio's cuFile (GPUDirect Storage), with a
POSIX ``O_DIRECT`` fallback. The directory layout, shared index and sandbox are the disk
tier's (``lmcache_backend_disk``). See ``docs/backends/gds.md``.

Importing this package is cheap: :class:`GdsBackend` and :class:`GdsOptions` are imported
on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["GdsBackend", "GdsOptions", "__version__"]

if TYPE_CHECKING:
    from .backend import GdsBackend
    from .options import GdsOptions


def __getattr__(name: str) -> Any:
    if name == "GdsBackend":
        from .backend import GdsBackend

        return GdsBackend
    if name == "GdsOptions":
        from .options import GdsOptions

        return GdsOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
