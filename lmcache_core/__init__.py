"""lmcache-core: tiered KV-cache storage for LLM serving.

The public API: keys (:class:`CacheEngineKey`, :class:`Namespace`), the token database
(:class:`ChunkedTokenDatabase`), the object format (:mod:`lmcache_core.format`), the
backend protocol (:class:`StorageBackend`, :class:`BaseBackend`, :class:`Capabilities`),
the backend interface and its optional capabilities (:mod:`lmcache_core.interface`), the
front door :func:`open_backend`, the synchronous facade (:class:`SyncBackend`) and the
built-in ``cpu`` backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Exports are imported lazily (PEP 562): `import lmcache_core` stays cheap (no torch) for
# the CLI and for vLLM's plugin entry point, which run in processes that may never store KV.
if TYPE_CHECKING:
    from .backend import BaseBackend
    from .backends.cpu import CPUBackend, CPUOptions
    from .config import CacheConfig, TierConfig, load_config
    from .errors import (
        BackendClosedError,
        BackendNotStartedError,
        BufferMismatchError,
        ConfigError,
        FormatError,
        KeyFormatError,
        LMCacheError,
        SizeFormatError,
        TokenInputError,
        TokenTypeError,
    )
    from .hierarchy.tiered import PrefixLookup, TieredHierarchy
    from .interface import INTERFACE_VERSION, Capabilities, StorageBackend
    from .keys import FORMAT_VERSION, NAMESPACE_VERSION, CacheEngineKey, Namespace
    from .open import open_backend
    from .sizes import format_bytes, parse_bytes
    from .sync import IOLoopThread, SyncBackend
    from .token_db import ChunkedTokenDatabase

_EXPORTS = {
    "BackendClosedError": "errors",
    "BackendNotStartedError": "errors",
    "BaseBackend": "backend",
    "BufferMismatchError": "errors",
    "CPUBackend": "backends.cpu",
    "CPUOptions": "backends.cpu",
    "CacheConfig": "config",
    "CacheEngineKey": "keys",
    "Capabilities": "interface",
    "ChunkedTokenDatabase": "token_db",
    "ConfigError": "errors",
    "FORMAT_VERSION": "keys",
    "FormatError": "errors",
    "INTERFACE_VERSION": "interface",
    "IOLoopThread": "sync",
    "KeyFormatError": "errors",
    "LMCacheError": "errors",
    "NAMESPACE_VERSION": "keys",
    "Namespace": "keys",
    "PrefixLookup": "hierarchy.tiered",
    "SizeFormatError": "errors",
    "StorageBackend": "interface",
    "SyncBackend": "sync",
    "TierConfig": "config",
    "TieredHierarchy": "hierarchy.tiered",
    "TokenInputError": "errors",
    "TokenTypeError": "errors",
    "format_bytes": "sizes",
    "load_config": "config",
    "open_backend": "open",
    "parse_bytes": "sizes",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lmcache_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "INTERFACE_VERSION",
    "NAMESPACE_VERSION",
    "BackendClosedError",
    "BackendNotStartedError",
    "BaseBackend",
    "BufferMismatchError",
    "CPUBackend",
    "CPUOptions",
    "CacheConfig",
    "CacheEngineKey",
    "Capabilities",
    "ChunkedTokenDatabase",
    "ConfigError",
    "FormatError",
    "IOLoopThread",
    "KeyFormatError",
    "LMCacheError",
    "Namespace",
    "PrefixLookup",
    "SizeFormatError",
    "StorageBackend",
    "SyncBackend",
    "TierConfig",
    "TieredHierarchy",
    "TokenInputError",
    "TokenTypeError",
    "__version__",
    "format_bytes",
    "load_config",
    "open_backend",
    "parse_bytes",
]
