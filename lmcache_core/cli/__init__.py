"""The ``lmcache-core`` command: :mod:`.main` dispatches to one module per command group.

A plugin adds its own subcommands through the ``lmcache_register_commands`` hook.
"""
