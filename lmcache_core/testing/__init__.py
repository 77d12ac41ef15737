"""Test support shipped with lmcache-core: the backend contract suite.

Importing this package needs ``pytest``.
"""

from __future__ import annotations

from .contract import (
    BackendContract,
    CapacityContract,
    CorruptionContract,
    NamespaceContract,
    PersistentContract,
    ProcessContract,
    SharedContract,
    make_key,
    random_tensor,
    run_async,
    same_bits,
)
from .reference import ReferenceBackend

__all__ = [
    "BackendContract",
    "CapacityContract",
    "CorruptionContract",
    "NamespaceContract",
    "PersistentContract",
    "ProcessContract",
    "ReferenceBackend",
    "SharedContract",
    "make_key",
    "random_tensor",
    "run_async",
    "same_bits",
]
