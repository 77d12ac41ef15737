"""Hook implementations of the built-in plugin ``lmcache-core`` (the ``cpu`` backend and
the placement policies ``lru``, ``arc``, ``s3fifo`` and ``cost``).

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


@hookimpl
def lmcache_register_policies(registry: BackendRegistry) -> None:
    """Register the built-in placement policies (docs/placement.md)."""
    for name in ("lru", "arc", "s3fifo", "cost"):
        registry.add_policy(name, f"lmcache_core.placement.wiring:{name}_policy")
