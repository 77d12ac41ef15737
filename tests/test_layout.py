"""The documented layout is the tree: ``docs/architecture.md`` names every module (and C
source) and package directly under ``lmcache_core/`` (and nothing that is gone), and every path in the
README's "What is in the box" table exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lmcache_core"


def top_level_names() -> set[str]:
    """``keys.py``, ``hierarchy/``, ``_speedups.c``, ...: what a reader finds in
    ``lmcache_core/`` (Python modules, C sources of compiled modules, packages)."""
    names = set()
    for p in PACKAGE.iterdir():
        if p.is_file() and p.suffix in (".py", ".c") and p.name != "__init__.py":
            names.add(p.name)
        elif p.is_dir() and (p / "__init__.py").exists():
            names.add(p.name + "/")
    return names


def documented_names() -> set[str]:
    """The first column of the ``lmcache_core/`` block of the architecture page's tree."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```\n", 2)[1]
    lines = block.splitlines()
    start = lines.index("lmcache_core/") + 1
    names = set()
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        if line.startswith("   "):  # a description's continuation line
            continue
        first_column = re.split(r"\s{3,}", line.strip(), maxsplit=1)[0]
        for name in first_column.split():
            top = name.split("/", 1)[0]
            names.add(top + "/" if "/" in name else top)
    return names


def test_the_architecture_page_names_every_module_and_package() -> None:
    tree, docs = top_level_names(), documented_names()
    assert tree - docs == set(), "in lmcache_core/ but not in docs/architecture.md's Layout"
    assert docs - tree == set(), "in docs/architecture.md's Layout but not in lmcache_core/"


def readme_paths() -> list[str]:
    """Paths of the README's "where" column; bare names are relative to the cell's first."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("## What is in the box\n", 1)[1].split("\n## ", 1)[0]
    paths = []
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[1].startswith("`"):
            continue
        items = re.findall(r"`([^`]+)`", cells[1])
        first = items[0].rstrip("/")
        base = first.rsplit("/", 1)[0] + "/" if "/" in first else ""
        paths.append(items[0])
        paths += [i if "/" in i.rstrip("/") else base + i for i in items[1:]]
    return paths


def test_every_readme_path_exists_and_every_package_is_in_it() -> None:
    paths = readme_paths()
    assert len(paths) > 10
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert missing == []
    packages = {n for n in top_level_names() if n.endswith("/")}
    named = {p.removeprefix("lmcache_core/").split("/", 1)[0] + "/" for p in paths}
    assert packages - named == set(), "packages of lmcache_core/ the README's table omits"


def test_every_lmcache_core_path_in_the_docs_exists() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    stale = []
    for page in pages:
        for path in re.findall(r"`(lmcache_core/[A-Za-z0-9_./]+)`", page.read_text("utf-8")):
            if not (ROOT / path).exists():
                stale.append(f"{page.relative_to(ROOT)}: {path}")
    assert stale == []
