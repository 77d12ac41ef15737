"""Hook implementation of the ``lmcache-backend-disk`` plugin (imports nothing heavy)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_core.plugins import hookimpl

if TYPE_CHECKING:
    from lmcache_core.plugins import BackendRegistry


@hookimpl
def lmcache_register_backends(registry: BackendRegistry) -> None:
    """Register the ``disk`` backend (``file://`` URLs) lazily."""
    registry.add(
        "lmcache_backend_disk.backend:DiskBackend",
        name="disk",
        schemes=("file",),
        install_hint="pip install ./backends/lmcache-backend-disk (in an lmcache-core checkout)",
    )
