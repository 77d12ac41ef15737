"""Checks of a registered backend class, for ``plugins --strict`` and ``backends``.

Registration stores ``"package.module:Class"`` without importing it, so a typo in the
target or a class that is not a backend would only show when a tier is built. These
checks import the class and say what is wrong, in words a plugin author can act on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .registry import BackendSpec

__all__ = ["backend_class_problems", "spec_problems"]


def backend_class_problems(cls: type[Any]) -> list[str]:
    """What keeps ``cls`` from being a usable backend class (empty when nothing)."""
    from ..backend import REQUIRED_METHODS

    where = f"{cls.__module__}.{cls.__qualname__}"
    problems = []
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        problems.append(
            f"{where} is not a storage backend: missing {', '.join(missing)} "
            "(subclass lmcache_core.backend.BaseBackend or lmcache_core.blob.BlobBackend)"
        )
    opts = getattr(cls, "Options", None)
    if not (isinstance(opts, type) and dataclasses.is_dataclass(opts)):
        problems.append(
            f"{where} declares no Options dataclass "
            "(`Options = <frozen dataclass made with lmcache_core.options.option>`)"
        )
    return problems


def spec_problems(spec: BackendSpec) -> list[str]:
    """Import ``spec``'s class and check it; each problem names the backend."""
    try:
        cls = spec.load()
    except Exception as exc:
        return [f"backend {spec.name!r}: {type(exc).__name__}: {exc}"]
    return [f"backend {spec.name!r}: {p}" for p in backend_class_problems(cls)]
