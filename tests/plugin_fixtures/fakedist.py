"""Fake distributions for plugin-loader tests: no installs, real importlib.metadata objects.

:class:`FakeDistribution` is an ``importlib.metadata.Distribution`` whose METADATA and
entry_points.txt come from memory, so its entry points carry ``.dist`` (name, version,
``Requires-Dist``) exactly like installed ones. :func:`write_dist_info` writes the same
files as a ``*.dist-info`` folder, which ``importlib.metadata`` discovers on ``sys.path`` /
``PYTHONPATH`` (used by the CLI tests, which run the real console script).
"""

from __future__ import annotations

from importlib.metadata import Distribution, EntryPoint
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent
GROUP = "lmcache_core"


def _metadata(name: str, version: str, requires: tuple[str, ...]) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    return "\n".join(lines) + "\n"


def _entry_points(name: str, target: str) -> str:
    return f"[{GROUP}]\n{name} = {target}\n"


class FakeDistribution(Distribution):
    """A distribution that exists only in memory."""

    def __init__(self, name: str, target: str, version: str, requires: tuple[str, ...]) -> None:
        self._files = {
            "METADATA": _metadata(name, version, requires),
            "entry_points.txt": _entry_points(name, target),
        }

    def read_text(self, filename: str) -> str | None:
        return self._files.get(filename)

    def locate_file(self, path: str | Path) -> Path:  # type: ignore[override]
        return FIXTURES / path


def fake_entry_point(
    name: str, target: str, *, version: str = "1.0.0", requires: tuple[str, ...] = ()
) -> EntryPoint:
    """The ``lmcache_core`` entry point of a fake distribution called ``name``."""
    (ep,) = FakeDistribution(name, target, version, requires).entry_points
    return ep


def write_dist_info(
    root: Path, name: str, target: str, *, version: str = "1.0.0", requires: tuple[str, ...] = ()
) -> Path:
    """Write ``<root>/<name>-<version>.dist-info`` so that ``root`` on sys.path provides it."""
    d = root / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(_metadata(name, version, requires))
    (d / "entry_points.txt").write_text(_entry_points(name, target))
    return d
