"""Hook implementation of the ``lmcache-codec-lossless`` plugin (imports nothing heavy)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_core.plugins import hookimpl

if TYPE_CHECKING:
    from lmcache_core.plugins.codec_registry import CodecRegistry


@hookimpl
def lmcache_register_codecs(registry: CodecRegistry) -> None:
    """Register the ``lossless`` codec lazily."""
    registry.add("lmcache_codec_lossless.codec:LosslessCodec", name="lossless", lossless=True)
