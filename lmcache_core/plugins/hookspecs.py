"""Hook specifications of lmcache-core plugins (pluggy project ``lmcache_core``).

Hooks are synchronous and do no I/O: they only declare what a plugin provides.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .registry import BackendRegistry

PROJECT_NAME = "lmcache_core"
#: Version of the hook interface. Plugins built for another major version are skipped.
HOOKSPEC_VERSION = "1.0"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def lmcache_register_backends(registry: BackendRegistry) -> None:
    """Register storage backends with ``registry.add(...)``.

    Called once per registry, first among the hooks. Register classes lazily as
    ``"package.module:Class"`` strings so that listing plugins imports nothing heavy.
    """
