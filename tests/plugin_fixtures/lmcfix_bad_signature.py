"""A plugin whose hook asks for an argument the hook does not have."""

from lmcache_core.plugins import hookimpl


@hookimpl
def lmcache_register_backends(registry, config):
    registry.add("lmcfix_backend:FixtureBackend", name="bad-signature")
