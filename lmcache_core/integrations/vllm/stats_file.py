"""Atomic JSON statistics files (one per connector process) for tools and the demo."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from ...redaction import scrub

__all__ = ["read_stats", "write_stats"]


def write_stats(directory: str, name: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``directory/name`` atomically; errors are ignored (stats are advisory)."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".stats.")
        with os.fdopen(fd, "w") as f:  # mkstemp: owner-only; config secrets scrubbed
            json.dump(scrub(data), f, sort_keys=True, default=str)
        os.replace(tmp, os.path.join(directory, name))
    except OSError:
        pass


def read_stats(directory: str) -> list[dict[str, Any]]:
    """Every statistics document in ``directory`` (unreadable files are skipped)."""
    out: list[dict[str, Any]] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return out
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            doc.setdefault("file", name)
            out.append(doc)
    return out
