"""Plugin system: pluggy hooks, entry-point discovery and the backend registry.

* :mod:`.hookspecs` — the hooks a plugin may implement (documented in ``docs/plugins/hooks.md``).
* :mod:`.loader` — discovery (entry-point group ``lmcache_core``) with per-plugin isolation.
* :mod:`.settings` — ``LMCACHE_CORE_STRICT_PLUGINS`` / ``_DISABLE_PLUGINS`` / ``_LOAD_PLUGINS``.
* :mod:`.registry` — backend names and URL schemes to lazily imported classes.
* :mod:`.backend_options` — validation and description of a backend's ``Options``.
"""

from __future__ import annotations

from .backend_options import (
    backend_options_class,
    describe_backend_options,
    options_markdown,
    validate_backend_options,
)
from .hookspecs import HOOKSPEC_VERSION, PROJECT_NAME, hookimpl, hookspec
from .loader import ENTRY_POINT_GROUP, discover_entry_points, load_plugins
from .registry import (
    KNOWN_BACKENDS,
    BackendLoadError,
    BackendRegistry,
    BackendSpec,
    get_registry,
    load_backend_class,
)
from .report import PluginInfo, PluginLoadError
from .settings import PluginSettings

__all__ = [
    "ENTRY_POINT_GROUP",
    "HOOKSPEC_VERSION",
    "KNOWN_BACKENDS",
    "PROJECT_NAME",
    "BackendLoadError",
    "BackendRegistry",
    "BackendSpec",
    "PluginInfo",
    "PluginLoadError",
    "PluginSettings",
    "backend_options_class",
    "describe_backend_options",
    "discover_entry_points",
    "get_registry",
    "hookimpl",
    "hookspec",
    "load_backend_class",
    "load_plugins",
    "options_markdown",
    "validate_backend_options",
]
