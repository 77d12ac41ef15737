"""Fixture plugin: registers a policy, then raises (everything it added is rolled back)."""

from __future__ import annotations

from lmcache_core.plugins.hookspecs import hookimpl


@hookimpl
def lmcache_register_backends(registry):
    registry.add("lmcfix_backend:FixtureBackend", name="fixture-rolled-back")


@hookimpl
def lmcache_register_policies(registry):
    registry.add_policy("doomed", lambda ctx: None)
    raise RuntimeError("policy hook broke")
