"""lmcache-codec-quant: lossy KV codecs ``int8``, ``int4`` (group scales) and ``fp8`` (e4m3).

Importing this package is cheap; the codec classes are imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Fp8Codec", "Int4Codec", "Int8Codec", "__version__"]

if TYPE_CHECKING:
    from .codec import Fp8Codec, Int4Codec, Int8Codec


def __getattr__(name: str) -> Any:
    if name in __all__ and name != "__version__":
        from . import codec

        return getattr(codec, name)
    raise AttributeError(name)
