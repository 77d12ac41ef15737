"""MkDocs hook: links from a page to a repository file outside ``docs/`` (an example, a
benchmark) are valid on a code host but have no page on the site. Such a link whose target
exists becomes the path in code (``examples/demo.py``); one whose target does not exist is
left alone, so ``mkdocs build --strict`` still fails on it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Turn links to existing repository files outside ``docs/`` into code paths."""
    here = (DOCS / page.file.src_uri).parent

    def fix(m: re.Match[str]) -> str:
        target = m["target"]
        if "://" in target or target.startswith(("mailto:", "/")):
            return m[0]
        path = (here / target).resolve()
        if path.is_relative_to(DOCS) or not path.exists() or not path.is_relative_to(ROOT):
            return m[0]
        rel = path.relative_to(ROOT).as_posix()
        text = m["text"]
        return (
            f"`{rel}`"
            if text.strip("`") == rel or text.strip("`") == target
            else f"{text} (`{rel}`)"
        )

    return LINK.sub(fix, markdown)
