"""A plugin that registers ``cpu``, which the built-in plugin already provides."""

from lmcache_core.plugins import hookimpl


@hookimpl
def lmcache_register_backends(registry):
    registry.add("lmcfix_backend:FixtureBackend", name="cpu")
