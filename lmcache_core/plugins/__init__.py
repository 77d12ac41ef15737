"""Plugin system: pluggy hooks, entry-point discovery and the backend registry."""

from __future__ import annotations

from .hookspecs import HOOKSPEC_VERSION, PROJECT_NAME, hookimpl, hookspec
from .registry import BackendRegistry, BackendSpec, get_registry

__all__ = [
    "HOOKSPEC_VERSION",
    "PROJECT_NAME",
    "BackendRegistry",
    "BackendSpec",
    "get_registry",
    "hookimpl",
    "hookspec",
]
