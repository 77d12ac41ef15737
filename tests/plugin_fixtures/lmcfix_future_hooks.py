"""A plugin built for a future major version of the hook interface."""

from lmcache_core.plugins import hookimpl

LMCACHE_HOOKSPEC_VERSION = "2.0"


@hookimpl
def lmcache_register_backends(registry):
    registry.add("lmcfix_backend:FixtureBackend", name="future")
