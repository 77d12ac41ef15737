"""A plugin whose registered class name is misspelled (``FixtureBackedn``)."""

from lmcache_core.plugins import hookimpl


@hookimpl
def lmcache_register_backends(registry):
    registry.add("lmcfix_backend:FixtureBackedn", name="typo")
