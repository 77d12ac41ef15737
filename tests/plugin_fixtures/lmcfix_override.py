"""A plugin that replaces ``cpu`` on purpose (``override=True``)."""

from lmcache_core.plugins import hookimpl


@hookimpl
def lmcache_register_backends(registry):
    registry.add("lmcfix_backend:FixtureBackend", name="cpu", override=True)
