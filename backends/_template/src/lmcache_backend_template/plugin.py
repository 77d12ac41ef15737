"""Hook implementation of the ``lmcache-backend-template`` plugin.

Only hook implementations live here, and nothing heavy is imported: ``lmcache-core
plugins`` and every process that builds the registry import this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_core.plugins import hookimpl

if TYPE_CHECKING:
    from lmcache_core.plugins import BackendRegistry

LMCACHE_HOOKSPEC_VERSION = "1.0"


@hookimpl
def lmcache_register_backends(registry: BackendRegistry) -> None:
    """Register the ``template`` backend; the class is imported on first use."""
    registry.add("lmcache_backend_template.backend:TemplateBackend", name="template")
