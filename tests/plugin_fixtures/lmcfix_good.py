"""A well-behaved plugin: registers ``fixture`` lazily, with URL scheme ``fixture``."""

from lmcache_core.plugins import hookimpl

LMCACHE_HOOKSPEC_VERSION = "1.0"


@hookimpl
def lmcache_register_backends(registry):
    registry.add("lmcfix_backend:FixtureBackend", name="fixture", schemes=("fixture",))
