"""Hook implementations of the built-in plugin (the ``cpu`` backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from ..plugins.registry import BackendRegistry


@hookimpl
def lmcache_register_backends(registry: BackendRegistry) -> None:
    registry.add(
        "lmcache_core.default_plugins.cpu:CPUBackend",
        name="cpu",
        schemes=("cpu", "memory"),
        install_hint="pip install lmcache-core",
    )
