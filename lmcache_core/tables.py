"""The one table renderer: aligned text for the CLI, Markdown for the generated docs.

:func:`format_table` lays rows out for a terminal (``lmcache-core plugins``, ``backends``,
``verify`` ...); :func:`markdown_table` writes the tables the documentation embeds (the
configuration keys, backend options, the interface's optional protocols, LMCache's keys).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["format_table", "markdown_table"]


def format_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """Left-aligned columns separated by two spaces; ``None`` shows as ``-``."""
    cells = [[str(h) for h in header]]
    cells += [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_cell(value: Any) -> str:
    """``value`` as one Markdown table cell: ``|`` escaped, line breaks as spaces,
    ``None`` empty."""
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A Markdown table (every cell through :func:`markdown_cell`), ending in a newline."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(markdown_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
