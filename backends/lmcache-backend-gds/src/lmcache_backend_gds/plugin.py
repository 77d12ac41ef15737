"""Hook implementation of the ``lmcache-backend-gds`` plugin (imports nothing heavy)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_core.plugins import hookimpl

if TYPE_CHECKING:
    from lmcache_core.plugins import BackendRegistry


@hookimpl
def lmcache_register_backends(registry: BackendRegistry) -> None:
    """Register the ``gds`` backend lazily (no URL scheme: it is configured by options)."""
    registry.add(
        "lmcache_backend_gds.backend:GdsBackend",
        name="gds",
        install_hint="pip install ./backends/lmcache-backend-gds (in an lmcache-core checkout)",
    )
