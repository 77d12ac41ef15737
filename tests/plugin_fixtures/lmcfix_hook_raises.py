"""A plugin that registers one backend, then raises in its hook."""

from lmcache_core.plugins import hookimpl


@hookimpl
def lmcache_register_backends(registry):
    registry.add("lmcfix_backend:FixtureBackend", name="half-done", schemes=("half",))
    raise ValueError("lmcfix_hook_raises failed half way")
