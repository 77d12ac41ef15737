"""Optional maintenance interface for persistent tiers (``inspect``, ``verify``, ``gc``).

A backend that stores objects somewhere durable (a directory, a bucket) implements
:class:`MaintainableBackend` (and optionally :class:`EntryChecks` and
:class:`Reconcilable`) in addition to :class:`~lmcache_core.StorageBackend`; the
``lmcache-core inspect/verify/gc`` commands then work on it whatever it is. The protocols
are declared in :mod:`lmcache_core.interface` and re-exported here.
"""

from __future__ import annotations

from .interface import (
    EntryChecks,
    EntryInfo,
    MaintainableBackend,
    ProgressCallback,
    Reconcilable,
)

__all__ = ["EntryChecks", "EntryInfo", "MaintainableBackend", "ProgressCallback", "Reconcilable"]
