"""lmcache-core: tiered KV-cache storage for LLM serving.

The public API: keys (:class:`CacheEngineKey`, :class:`Namespace`), the token database
(:class:`ChunkedTokenDatabase`), the object format (:mod:`lmcache_core.format`), the
backend protocol (:class:`StorageBackend`, :class:`BaseBackend`, :class:`Capabilities`),
the synchronous facade (:class:`SyncBackend`) and the built-in ``cpu`` backend.
"""

from __future__ import annotations

from .backend import BaseBackend, Capabilities, StorageBackend
from .config import CacheConfig, TierConfig, load_config
from .default_plugins.cpu import CPUBackend, CPUOptions
from .errors import (
    BackendClosedError,
    BackendNotStartedError,
    BufferMismatchError,
    ConfigError,
    FormatError,
    KeyFormatError,
    LMCacheError,
    SizeFormatError,
)
from .hierarchy import PrefixLookup, TieredHierarchy
from .keys import FORMAT_VERSION, CacheEngineKey, Namespace
from .sizes import format_bytes, parse_bytes
from .sync import IOLoopThread, SyncBackend
from .token_db import ChunkedTokenDatabase

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
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
    "__version__",
    "format_bytes",
    "load_config",
    "parse_bytes",
]
