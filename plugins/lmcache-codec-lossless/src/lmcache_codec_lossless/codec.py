"""The ``lossless`` KV codec: a byte shuffle, then a fast general-purpose compressor.

Floating-point KV compresses poorly as it is (mantissa bytes look random) but well once
the bytes are *shuffled*: all first bytes of the elements, then all second bytes, and so
on; the sign/exponent bytes then form long, low-entropy runs. Compressors:

``blosc2-lz4`` (default), ``blosc2-zstd``, ``blosc2-blosclz``
    C-Blosc2 does the shuffle (``shuffle: byte``) or bit shuffle (``bit``) and the
    compression in one pass and decompresses straight into the caller's tensor.
``zstd``, ``lz4``
    ``zstandard`` / ``lz4`` after a numpy byte shuffle into a scratch buffer. ``zstd``
    decompresses into the scratch buffer; python-lz4 has no decompress-into, so ``lz4``
    allocates its output on every decode (kept for measurement only).

The choice of default comes from ``lmcache-core bench codecs`` (docs/codecs.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from lmcache_core.codecs import (
    FRAME_BYTES,
    CodecError,
    Scratch,
    byte_view,
    read_frame,
    read_stream_into,
    write_frame,
)

__all__ = ["COMPRESSORS", "LosslessCodec"]

#: Accepted ``compressor`` values.
COMPRESSORS = ("blosc2-lz4", "blosc2-zstd", "blosc2-blosclz", "zstd", "lz4")
_SHUFFLES = ("byte", "bit", "none")
_TAG = b"LSLS"
_VERSION = 1


class LosslessCodec:
    """Bit-exact KV compression (codec name ``lossless``).

    Options: ``compressor`` (one of :data:`COMPRESSORS`), ``level`` (the compressor's
    level: 0-9 for blosc2, 1-22 for zstd, ignored by lz4), ``shuffle`` (``byte``,
    ``bit`` - blosc2 only - or ``none``) and ``threads`` (blosc2's threads; 1 keeps the
    copy single-threaded, as the project's host copies are).
    """

    name = "lossless"
    lossless = True
    VALID: ClassVar[dict[str, Any]] = {
        "compressor": COMPRESSORS,
        "shuffle": _SHUFFLES,
    }

    def __init__(
        self,
        compressor: str = "blosc2-lz4",
        level: int = 1,
        shuffle: str = "byte",
        threads: int = 1,
    ) -> None:
        if compressor not in COMPRESSORS:
            raise ValueError(
                f"compressor must be one of {', '.join(COMPRESSORS)}, not {compressor!r}"
            )
        if shuffle not in _SHUFFLES:
            raise ValueError(f"shuffle must be one of {', '.join(_SHUFFLES)}, not {shuffle!r}")
        if shuffle == "bit" and not compressor.startswith("blosc2"):
            raise ValueError("shuffle 'bit' needs a blosc2 compressor")
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 22:
            raise ValueError(f"level must be an integer 0-22, not {level!r}")
        if compressor.startswith("blosc2") and level > 9:
            raise ValueError(f"blosc2 levels are 0-9, not {level}")
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise ValueError(f"threads must be an integer 1-64, not {threads!r}")
        self.compressor = compressor
        self.level = level
        self.shuffle = shuffle
        self.threads = threads
        self._scratch = Scratch()
        if compressor.startswith("blosc2"):
            import blosc2

            codec = {
                "lz4": blosc2.Codec.LZ4,
                "zstd": blosc2.Codec.ZSTD,
                "blosclz": blosc2.Codec.BLOSCLZ,
            }
            filt = {
                "byte": blosc2.Filter.SHUFFLE,
                "bit": blosc2.Filter.BITSHUFFLE,
                "none": blosc2.Filter.NOFILTER,
            }
            self._blosc_codec = codec[compressor.split("-", 1)[1]]
            self._blosc_filter = filt[shuffle]
        elif compressor == "zstd":
            import zstandard

            self._zstd = zstandard

    def options(self) -> dict[str, Any]:
        """The options recorded with every object (``threads`` does not change the bytes)."""
        return {"compressor": self.compressor, "level": self.level, "shuffle": self.shuffle}

    # ------------------------------------------------------------------ encode
    def encode(self, tensor: torch.Tensor) -> memoryview:
        """Compress ``tensor``'s bytes; the view is valid until this thread's next call."""
        src = byte_view(tensor.contiguous())
        itemsize = tensor.element_size()
        if src.size == 0:
            body = b""
        elif self.compressor.startswith("blosc2"):
            body = self._blosc_compress(src, itemsize)
        else:
            body = self._shuffled_compress(src, itemsize)
        out = self._scratch.numpy("enc", FRAME_BYTES + len(body))
        out[FRAME_BYTES:] = np.frombuffer(body, dtype=np.uint8)
        n = write_frame(out, _TAG, _VERSION, tensor.dtype, tensor.numel(), len(body))
        return out.data[:n]

    def _blosc_compress(self, src: np.ndarray[Any, Any], itemsize: int) -> bytes:
        import blosc2

        return bytes(
            blosc2.compress2(
                src,
                typesize=itemsize,
                clevel=self.level,
                codec=self._blosc_codec,
                filters=[self._blosc_filter],
                nthreads=self.threads,
            )
        )

    def _shuffle_into(self, src: np.ndarray[Any, Any], itemsize: int) -> np.ndarray[Any, Any]:
        if self.shuffle == "none" or itemsize == 1:
            return src
        n = src.size // itemsize
        dst = self._scratch.numpy("shuffle", src.size)
        np.copyto(dst.reshape(itemsize, n), src.reshape(n, itemsize).T)
        return dst

    def _shuffled_compress(self, src: np.ndarray[Any, Any], itemsize: int) -> bytes:
        data = self._shuffle_into(src, itemsize)
        if self.compressor == "zstd":
            # a ZstdCompressor is not thread-safe: one per call is cheap next to the data
            comp = self._zstd.ZstdCompressor(level=max(self.level, 1))
            return bytes(comp.compress(data.data))
        import lz4.block

        return bytes(lz4.block.compress(data, store_size=False))

    # ------------------------------------------------------------------ decode
    def decode_into(self, buf: Any, out: torch.Tensor) -> None:
        """Decompress ``buf`` into ``out``; :class:`CodecError` if it cannot."""
        frame = read_frame(buf, _TAG, (_VERSION,), out)
        dst = byte_view(out)
        if dst.size == 0:
            if len(frame.body):
                raise CodecError("stream has data for an empty tensor")
            return
        itemsize = out.element_size()
        try:
            if self.compressor.startswith("blosc2"):
                self._blosc_decompress(frame.body, dst)
            else:
                self._shuffled_decompress(frame.body, dst, itemsize)
        except CodecError:
            raise
        except Exception as exc:  # every decompressor's own error is a damaged stream
            raise CodecError(f"{self.compressor} could not decompress: {exc}") from exc

    def _blosc_decompress(self, body: memoryview, dst: np.ndarray[Any, Any]) -> None:
        import blosc2

        # blosc2 checks the chunk's own header (sizes) before writing; a body whose
        # declared size differs from the tensor is refused rather than over-written.
        nbytes, _cbytes, _blocksize = blosc2.get_cbuffer_sizes(body)
        if nbytes != dst.size:
            raise CodecError(f"compressed chunk holds {nbytes} bytes, tensor needs {dst.size}")
        blosc2.decompress2(body, dst=dst, nthreads=self.threads)

    def _shuffled_decompress(
        self, body: memoryview, dst: np.ndarray[Any, Any], itemsize: int
    ) -> None:
        unshuffle = self.shuffle != "none" and itemsize > 1
        target = self._scratch.numpy("shuffle", dst.size) if unshuffle else dst
        if self.compressor == "zstd":
            reader = self._zstd.ZstdDecompressor().stream_reader(body)
            read_stream_into(reader, target.data, "zstd stream")
        else:
            import lz4.block

            raw = lz4.block.decompress(body, uncompressed_size=dst.size)
            if len(raw) != dst.size:
                raise CodecError(f"lz4 block holds {len(raw)} bytes, tensor needs {dst.size}")
            target[:] = np.frombuffer(raw, dtype=np.uint8)
        if unshuffle:
            n = dst.size // itemsize
            np.copyto(dst.reshape(n, itemsize), target.reshape(itemsize, n).T)
