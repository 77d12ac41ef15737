"""Fixture plugin: a placement policy (newest stored chunk evicted first)."""

from __future__ import annotations

from lmcache_core.placement import LRUPolicy
from lmcache_core.plugins.hookspecs import hookimpl


class NewestFirst(LRUPolicy):
    name = "newest-first"

    def victim(self, exclude=frozenset()):
        for key in reversed(self._queue):
            if key not in exclude:
                return key
        return None


@hookimpl
def lmcache_register_policies(registry):
    registry.add_policy("newest-first", lambda ctx: NewestFirst())
