"""A plugin that registers a class missing the backend methods (and ``Options``)."""

from lmcache_core.plugins import hookimpl


@hookimpl
def lmcache_register_backends(registry):
    registry.add("lmcfix_backend:NoOptionsBackend", name="hollow")
