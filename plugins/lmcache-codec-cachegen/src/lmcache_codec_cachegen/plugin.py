"""Hook implementation of the ``lmcache-codec-cachegen`` plugin (imports nothing heavy)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_core.plugins import hookimpl

if TYPE_CHECKING:
    from lmcache_core.plugins.codec_registry import CodecRegistry


@hookimpl
def lmcache_register_codecs(registry: CodecRegistry) -> None:
    """Register the ``cachegen`` codec lazily."""
    registry.add("lmcache_codec_cachegen.codec:CacheGenCodec", name="cachegen", lossless=False)
