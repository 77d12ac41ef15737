"""Hook implementation of the ``lmcache-codec-quant`` plugin (imports nothing heavy)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache_core.plugins import hookimpl

if TYPE_CHECKING:
    from lmcache_core.plugins.codec_registry import CodecRegistry


@hookimpl
def lmcache_register_codecs(registry: CodecRegistry) -> None:
    """Register the ``int8``, ``int4`` and ``fp8`` codecs lazily."""
    registry.add("lmcache_codec_quant.codec:Int8Codec", name="int8", lossless=False)
    registry.add("lmcache_codec_quant.codec:Int4Codec", name="int4", lossless=False)
    registry.add("lmcache_codec_quant.codec:Fp8Codec", name="fp8", lossless=False)
