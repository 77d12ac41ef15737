"""Hook implementation of the ``lmcache-backend-s3`` plugin (imports nothing heavy)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_core.plugins import hookimpl

if TYPE_CHECKING:
    from lmcache_core.plugins import BackendRegistry


@hookimpl
def lmcache_register_backends(registry: BackendRegistry) -> None:
    """Register the ``s3`` backend (``s3://`` URLs) lazily."""
    registry.add(
        "lmcache_backend_s3.backend:S3Backend",
        name="s3",
        schemes=("s3",),
        install_hint="pip install ./backends/lmcache-backend-s3 (in an lmcache-core checkout)",
    )
