"""A second well-behaved plugin: registers ``other``."""

from lmcache_core.plugins import hookimpl


@hookimpl
def lmcache_register_backends(registry):
    registry.add("lmcfix_backend:FixtureBackend", name="other")
