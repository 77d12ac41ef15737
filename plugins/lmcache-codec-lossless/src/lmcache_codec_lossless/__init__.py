"""lmcache-codec-lossless: byte-shuffled lossless compression of KV chunks (codec ``lossless``).

Importing this package is cheap; :class:`LosslessCodec` is imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LosslessCodec", "__version__"]

if TYPE_CHECKING:
    from .codec import LosslessCodec


def __getattr__(name: str) -> Any:
    if name == "LosslessCodec":
        from .codec import LosslessCodec

        return LosslessCodec
    raise AttributeError(name)
