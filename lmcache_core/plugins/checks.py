"""Checks of a registered backend class, for ``plugins --strict`` and ``backends``.

Registration stores ``"package.module:Class"`` without importing it, so a typo in the
target or a class that is not a backend would only show when a tier is built. These
checks import the class, check it against the declared interface
(:func:`lmcache_core.interface.check_backend_class`: required methods, optional
capabilities implemented in part, the interface version) and its ``Options``, and say
what is wrong, in words a plugin author can act on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..interface import ClassCheck, check_backend_class
from .registry import BackendSpec

__all__ = ["backend_class_check", "backend_class_problems", "spec_problems"]


def backend_class_check(cls: type[Any]) -> ClassCheck:
    """:func:`~lmcache_core.interface.check_backend_class` plus the ``Options`` check."""
    check = check_backend_class(cls)
    opts = getattr(cls, "Options", None)
    if not (isinstance(opts, type) and dataclasses.is_dataclass(opts)):
        check.problems.append(
            f"{cls.__module__}.{cls.__qualname__} declares no Options dataclass "
            "(`Options = <frozen dataclass made with lmcache_core.config.options.option>`)"
        )
    return check


def backend_class_problems(cls: type[Any]) -> list[str]:
    """What keeps ``cls`` from being a usable backend class (empty when nothing)."""
    return backend_class_check(cls).problems


def spec_problems(spec: BackendSpec) -> list[str]:
    """Import ``spec``'s class and check it; each problem names the backend."""
    try:
        cls = spec.load()
    except Exception as exc:
        return [f"backend {spec.name!r}: {type(exc).__name__}: {exc}"]
    return [f"backend {spec.name!r}: {p}" for p in backend_class_problems(cls)]
