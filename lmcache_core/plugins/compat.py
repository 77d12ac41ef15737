"""Compatibility checks between a plugin and the running lmcache-core.

Two checks, both done before a plugin's hooks run:

* its distribution's ``Requires-Dist: lmcache-core <specifier>`` must accept the running
  core version (checked from metadata alone, before the plugin is imported);
* a plugin module may declare ``LMCACHE_HOOKSPEC_VERSION = "1.0"``; its major version must
  equal the major of :data:`~lmcache_core.plugins.hookspecs.HOOKSPEC_VERSION`.

``packaging`` is used when it is installed; otherwise a small parser handles the usual
specifiers (``>=``, ``<=``, ``>``, ``<``, ``==`` with ``.*``, ``!=``, ``~=``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version

from .hookspecs import HOOKSPEC_VERSION

__all__ = [
    "CORE_DISTRIBUTION",
    "canonical_name",
    "core_requirement_problem",
    "core_version",
    "hookspec_problem",
]

CORE_DISTRIBUTION = "lmcache-core"


def canonical_name(name: str) -> str:
    """PEP 503 normalized name: ``LMCache_Backend.Disk`` -> ``lmcache-backend-disk``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def core_version() -> str:
    """Version of the running lmcache-core distribution."""
    try:
        return version(CORE_DISTRIBUTION)
    except PackageNotFoundError:  # running from a source tree that is not installed
        from .. import __version__

        return __version__


def core_requirement_problem(requires: Iterable[str] | None, running: str) -> str | None:
    """Why ``requires`` (a distribution's ``Requires-Dist`` lines) rejects core ``running``.

    ``None`` when there is no ``lmcache-core`` requirement or it is satisfied. Requirements
    that only apply to an extra (``; extra == "test"``) are ignored.
    """
    for line in requires or ():
        parsed = _parse_requirement(line)
        if parsed is None:
            continue
        name, spec = parsed
        if canonical_name(name) != CORE_DISTRIBUTION or not spec:
            continue
        if not _satisfies(running, spec):
            return (
                f"requires {CORE_DISTRIBUTION}{spec} but the running {CORE_DISTRIBUTION} "
                f"is {running}"
            )
    return None


def hookspec_problem(declared: object) -> str | None:
    """Why a plugin's declared ``LMCACHE_HOOKSPEC_VERSION`` does not match ours, or ``None``."""
    if declared is None:
        return None
    mine = HOOKSPEC_VERSION.split(".")[0]
    theirs = str(declared).split(".")[0]
    if theirs != mine:
        return (
            f"targets hook interface {declared} but this {CORE_DISTRIBUTION} {core_version()} "
            f"provides hook interface {HOOKSPEC_VERSION}"
        )
    return None


# --------------------------------------------------------------------------- parsing
def _parse_requirement(line: str) -> tuple[str, str] | None:
    """``(name, specifier)`` of a requirement that applies without extras, else ``None``."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # pragma: no cover - packaging is nearly always installed
        return _parse_requirement_fallback(line)
    try:
        req = Requirement(line)
    except InvalidRequirement:
        return None
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        return None
    return req.name, str(req.specifier)


_REQ_RE = re.compile(
    r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?([^;)]*)\)?\s*(;.*)?$"
)


def _parse_requirement_fallback(line: str) -> tuple[str, str] | None:
    m = _REQ_RE.match(line)
    if m is None:
        return None
    marker = m.group(3) or ""
    if "extra" in marker:
        return None
    return m.group(1), m.group(2).replace(" ", "")


def _satisfies(running: str, spec: str) -> bool:
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover
        return _satisfies_fallback(running, spec)
    try:
        return SpecifierSet(spec).contains(Version(running), prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return True  # an unparsable requirement is not ours to enforce


def _release(text: str) -> tuple[int, ...]:
    nums = re.match(r"\d+(?:\.\d+)*", text.strip().lstrip("v"))
    return tuple(int(p) for p in nums.group(0).split(".")) if nums else ()


def _cmp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = max(len(a), len(b))
    pa, pb = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
    return (pa > pb) - (pa < pb)


def _satisfies_fallback(running: str, spec: str) -> bool:
    """Release-segment comparison for ``>=1.0,<2`` style specifiers (pre-releases ignored)."""
    have = _release(running)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = re.match(r"(~=|==|!=|>=|<=|>|<)\s*(.+)", clause)
        if m is None:
            return True
        op, want_text = m.groups()
        if op in ("==", "!=") and want_text.endswith(".*"):
            prefix = _release(want_text[:-2])
            equal = have[: len(prefix)] == prefix
            ok = equal if op == "==" else not equal
        else:
            want = _release(want_text)
            c = _cmp(have, want)
            if op == "~=":
                ok = c >= 0 and have[: len(want) - 1] == want[: len(want) - 1]
            else:
                ok = {
                    "==": c == 0,
                    "!=": c != 0,
                    ">=": c >= 0,
                    "<=": c <= 0,
                    ">": c > 0,
                    "<": c < 0,
                }[op]
        if not ok:
            return False
    return True
