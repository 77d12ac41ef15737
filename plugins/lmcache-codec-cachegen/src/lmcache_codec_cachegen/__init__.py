"""lmcache-codec-cachegen: the CacheGen-style lossy KV codec (codec ``cachegen``).

Importing this package is cheap; :class:`CacheGenCodec` is imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["CacheGenCodec", "__version__"]

if TYPE_CHECKING:
    from .codec import CacheGenCodec


def __getattr__(name: str) -> Any:
    if name == "CacheGenCodec":
        from .codec import CacheGenCodec

        return CacheGenCodec
    raise AttributeError(name)
