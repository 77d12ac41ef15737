"""A plugin that records that it was imported (to prove incompatible ones are not)."""

import sys

from lmcache_core.plugins import hookimpl

sys.modules.setdefault("lmcfix_import_tracker_was_imported", sys.modules[__name__])


@hookimpl
def lmcache_register_backends(registry):
    registry.add("lmcfix_backend:FixtureBackend", name="tracked")
