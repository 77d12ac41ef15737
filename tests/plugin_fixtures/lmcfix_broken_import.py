"""A plugin that raises while being imported."""

raise RuntimeError("lmcfix_broken_import exploded at import")
