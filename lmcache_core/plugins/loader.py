"""Plugin discovery (minimal version; the plugin issue adds isolation and controls)."""

from __future__ import annotations

from importlib.metadata import entry_points

import pluggy

from . import hookspecs
from .registry import BackendRegistry

ENTRY_POINT_GROUP = "lmcache_core"


def load_plugins(registry: BackendRegistry) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    from ..default_plugins import builtin

    pm.register(builtin, name="lmcache-core")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        pm.register(ep.load(), name=ep.name)
    pm.check_pending()
    for impl in pm.hook.lmcache_register_backends.get_hookimpls():
        registry.current_provider = impl.plugin_name
        impl.function(registry=registry)
    registry.current_provider = "unknown"
    return pm
