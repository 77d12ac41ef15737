"""The tiered hierarchy (:mod:`.tiered`) and its building blocks.

:class:`TieredHierarchy` and :class:`PrefixLookup` live in :mod:`.tiered`.
``tier`` wraps one backend with failure isolation, deadlines and statistics; ``writer``
runs its bounded background-store queue; ``staging`` recycles the buffers that carry
chunks to background stores; ``admission`` counts sightings; ``health`` the retry
backoff; ``leases`` the pins taken by lookups; ``stats`` the live statistics.
The names are imported lazily (PEP 562): ``lmcache_core.hierarchy.stats`` does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tiered import EvictionListener, PrefixLookup, TieredHierarchy

__all__ = ["EvictionListener", "PrefixLookup", "TieredHierarchy"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".tiered", __name__), name)
    globals()[name] = value
    return value
