"""Hook specifications of lmcache-core plugins (pluggy project ``lmcache_core``).

Hooks are synchronous and do no I/O: they only declare what a plugin provides. Every hook
is documented, with its exact signature, in ``docs/plugins/hooks.md`` (a test checks it).

A plugin module may declare ``LMCACHE_HOOKSPEC_VERSION = "1.0"``: when its major version
differs from :data:`HOOKSPEC_VERSION`, the plugin is skipped with a message naming both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse

    from .registry import BackendRegistry

__all__ = [
    "HOOKSPEC_VERSION",
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "lmcache_register_backends",
    "lmcache_register_commands",
    "lmcache_register_policies",
]

PROJECT_NAME = "lmcache_core"
#: Version of the hook interface. Plugins built for another major version are skipped.
HOOKSPEC_VERSION = "1.0"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def lmcache_register_backends(registry: BackendRegistry) -> None:
    """Register storage backends with ``registry.add(...)``.

    Called once per registry, first among the hooks. Register classes lazily as
    ``"package.module:Class"`` strings so that listing plugins imports nothing heavy.
    """


@hookspec
def lmcache_register_policies(registry: BackendRegistry) -> None:
    """Register placement policies with ``registry.add_policy(name, factory)``.

    Called once per registry, after ``lmcache_register_backends``, once per plugin in
    load order. ``factory(context) -> policy`` gets a
    :class:`~lmcache_core.placement.wiring.PolicyContext` (the tier's name, capacity,
    chunk size, sharedness and its ``placement:`` options) and returns a fresh
    :class:`~lmcache_core.placement.base.PlacementPolicy` for that tier; it may be given
    as ``"package.module:attr"`` text, imported on first use. A configuration chooses one
    with ``placement: {policy: NAME}``. A hook that raises is rolled back like a backend
    hook.
    """


@hookspec
def lmcache_register_commands(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``lmcache-core`` subcommands with ``subparsers.add_parser(...)``.

    Called when the ``lmcache-core`` command builds its parser, after the built-in
    commands, once per plugin in load order. Each new parser sets
    ``set_defaults(func=handler)``; ``handler(args: argparse.Namespace) -> int`` returns
    the exit status. A hook that raises (or takes a name already used) is reported on
    stderr and its commands are left out; the other commands still work.
    """
