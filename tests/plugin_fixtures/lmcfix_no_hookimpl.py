"""A plugin whose hook function lacks ``@hookimpl``: pluggy sees no hook at all."""


def lmcache_register_backends(registry):
    registry.add("lmcfix_backend:FixtureBackend", name="forgotten")
