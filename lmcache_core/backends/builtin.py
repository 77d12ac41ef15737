"""Hook implementations of the built-in plugin ``lmcache-core`` (the ``cpu`` backend).

It is registered by the loader through the same hooks as third-party plugins, before any
of them, and cannot be disabled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from ..plugins.registry import BackendRegistry


@hookimpl
def lmcache_register_backends(registry: BackendRegistry) -> None:
    """Register the host-memory ``cpu`` backend (URL schemes ``cpu://`` and ``memory://``)."""
    registry.add(
        "lmcache_core.backends.cpu:CPUBackend",
        name="cpu",
        schemes=("cpu", "memory"),
        install_hint="pip install -e . (in an lmcache-core checkout)",
    )
