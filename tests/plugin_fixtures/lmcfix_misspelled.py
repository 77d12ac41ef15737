"""A plugin with a misspelled hook name (``backend`` instead of ``backends``)."""

from lmcache_core.plugins import hookimpl


@hookimpl
def lmcache_register_backend(registry):
    registry.add("lmcfix_backend:FixtureBackend", name="misspelled")
