"""Configuration: the schema declared once (:mod:`.schema`, with the typed options of
:mod:`.options`), loading YAML/JSON/dicts with errors that carry the path
(:mod:`.loading`), the reference tables of the docs (:mod:`.reference`) and the
hierarchy's namespace (:mod:`.namespaces`).

``from lmcache_core.config import CacheConfig, TierConfig, load_config`` keeps working;
the names are imported lazily (PEP 562), so importing :mod:`lmcache_core.config.options`
from a backend does not load the whole schema.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .loading import load_config
    from .reference import schema_markdown
    from .schema import (
        DEFAULT_TIERS,
        REDACTED,
        CacheConfig,
        NamespaceSettings,
        NotImported,
        TierConfig,
        TierSettings,
        TopLevelSettings,
        WriteSettings,
        redact_url,
    )

__all__ = [
    "DEFAULT_TIERS",
    "REDACTED",
    "CacheConfig",
    "NamespaceSettings",
    "NotImported",
    "TierConfig",
    "TierSettings",
    "TopLevelSettings",
    "WriteSettings",
    "load_config",
    "redact_url",
    "schema_markdown",
]


_MODULES = {"load_config": ".loading", "schema_markdown": ".reference"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULES.get(name, ".schema"), __name__), name)
    globals()[name] = value
    return value
