"""Hook implementation of the ``lmcache-backend-sqlite`` plugin (imports nothing heavy)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_core.plugins import hookimpl

if TYPE_CHECKING:
    from lmcache_core.plugins import BackendRegistry

LMCACHE_HOOKSPEC_VERSION = "1.0"


@hookimpl
def lmcache_register_backends(registry: BackendRegistry) -> None:
    """Register the ``sqlite`` backend, imported lazily on first use."""
    registry.add(
        "lmcache_backend_sqlite.backend:SQLiteBackend",
        name="sqlite",
        install_hint="pip install lmcache-backend-sqlite",
    )
