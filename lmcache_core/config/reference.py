"""The option tables of ``docs/configuration.md``, rendered from the schema (:mod:`.schema`)."""

from __future__ import annotations

from typing import Any

from ..tables import markdown_table
from .options import describe_options
from .schema import (
    NamespaceSettings,
    PlacementSettings,
    TierSettings,
    TopLevelSettings,
    WriteSettings,
)

__all__ = ["schema_markdown"]


# ---------------------------------------------------------------------------- docs
def _table(cls: type[Any], prefix: str = "") -> str:
    rows = []
    for o in describe_options(cls):
        kind = o["type"] + (f" ({', '.join(o['choices'])})" if o["choices"] else "")
        default = o["default_text"]
        if isinstance(o["default"], bool):
            default = str(o["default"]).lower()
        if o["name"] == "tiers" and not prefix:
            default = "one cpu tier"
        elif o["name"] in ("namespace", "placement") and not prefix:
            kind = "dict or str"
        elif o["type"] == "dict" and default == "{}":
            default = "{}"
        rows.append([f"`{prefix}{o['name']}`", kind, f"`{default}`" if default else "", o["doc"]])
    return markdown_table(rows, ["Key", "Type", "Default", "Description"])


def schema_markdown() -> str:
    """Markdown tables of every configuration key (embedded in ``docs/configuration.md``)."""
    return (
        "### Top-level keys\n\n"
        + _table(TopLevelSettings)
        + "\n### Tier keys (each entry of `tiers`)\n\n"
        + _table(TierSettings)
        + "\n### Write keys (a tier's `write`)\n\n"
        + _table(WriteSettings, "write.")
        + "\n### Namespace keys (the top-level `namespace`)\n\n"
        + _table(NamespaceSettings, "namespace.")
        + "\n### Placement keys (the top-level `placement`)\n\n"
        + _table(PlacementSettings, "placement.")
    )
