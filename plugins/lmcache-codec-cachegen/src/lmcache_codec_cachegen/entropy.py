"""Entropy coders for the CacheGen-style codec's symbols (uint8 in an alphabet per context).

``range``: an adaptive-by-chunk range coder (``constriction``'s ``RangeEncoder``): one
categorical model per context (a K or V tensor of one layer, anchors and deltas apart),
fitted to the chunk's own symbol counts, which travel in the stream (16-bit counts).
``zstd``: the symbols of each context as bytes through zstd, one frame per context (a
32-bit length before each), whose literal section is Huffman-coded with tables fitted to
that context. One frame for all contexts was measured worse: zstd keeps a block raw when
Huffman gains too little over the whole block, and a block mixing 8-bit with 6- or 7-bit
contexts stayed raw, 8 bits for every symbol.

Both write into and read from caller buffers where the library allows: zstd decodes into
the codec's scratch buffer; constriction returns a new int32 array per context (it has no
decode-into), which the range mode pays on every decode.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from lmcache_core.codecs import CodecError, read_stream_into

__all__ = ["ENTROPY_CODERS", "decode_symbols", "encode_symbols"]

ENTROPY_CODERS = ("zstd", "range")
_U32 = struct.Struct("<I")
_CTX = struct.Struct("<II")  # alphabet size, compressed words


def encode_symbols(
    symbols: np.ndarray[Any, np.dtype[np.uint8]],
    contexts: Sequence[tuple[int, int, int]],
    coder: str,
    level: int,
) -> bytes:
    """Entropy-code ``symbols``; ``contexts`` are ``(start, stop, alphabet)`` slices that
    cover it in order (the range coder fits one model per context)."""
    if coder == "zstd":
        import zstandard

        zc = zstandard.ZstdCompressor(level=level)
        frames: list[bytes] = []
        for start, stop, _ in contexts:
            frame = zc.compress(symbols[start:stop].data)
            frames += [_U32.pack(len(frame)), frame]
        return b"".join(frames)
    import constriction

    parts: list[bytes] = []
    for start, stop, alphabet in contexts:
        seg = symbols[start:stop]
        counts = np.bincount(seg, minlength=alphabet)[:alphabet].astype(np.float64)
        if counts.size and counts.max() > 0:
            counts = np.maximum(np.round(counts * (65535.0 / counts.max())), counts > 0)
        table = counts.astype(np.uint16)
        enc = constriction.stream.queue.RangeEncoder()
        if seg.size:
            model = constriction.stream.model.Categorical(
                np.maximum(table.astype(np.float32), 0), perfect=False
            )
            enc.encode(seg.astype(np.int32), model)
        words = enc.get_compressed().astype("<u4")
        parts += [_CTX.pack(alphabet, words.size), table.tobytes(), words.tobytes()]
    return b"".join(parts)


def _zstd_into(dctx: Any, frame: memoryview, target: memoryview) -> None:
    """Decompress one zstd ``frame`` into ``target`` exactly (no output allocation)."""
    import zstandard

    try:
        read_stream_into(dctx.stream_reader(frame), target, "a zstd symbol context")
    except zstandard.ZstdError as exc:
        raise CodecError(f"zstd could not decode the symbols: {exc}") from exc


def decode_symbols(
    body: Any,
    out: np.ndarray[Any, np.dtype[np.uint8]],
    contexts: Sequence[tuple[int, int, int]],
    coder: str,
) -> None:
    """Decode the output of :func:`encode_symbols` into ``out``; :class:`CodecError`
    when the bytes do not hold exactly that many symbols."""
    view = memoryview(body).cast("B")
    if coder == "zstd":
        import zstandard

        dctx = zstandard.ZstdDecompressor()
        target = out.data
        pos = 0
        for start, stop, _ in contexts:
            if pos + _U32.size > len(view):
                raise CodecError("zstd-coded symbols are truncated")
            (size,) = _U32.unpack_from(view, pos)
            pos += _U32.size
            if pos + size > len(view):
                raise CodecError("zstd-coded symbols are truncated")
            _zstd_into(dctx, view[pos : pos + size], target[start:stop])
            pos += size
        if pos != len(view):
            raise CodecError("zstd-coded symbols have trailing bytes")
        return
    import constriction

    pos = 0
    for start, stop, alphabet in contexts:
        if pos + _CTX.size > len(view):
            raise CodecError("range-coded symbols are truncated")
        got_alphabet, nwords = _CTX.unpack_from(view, pos)
        pos += _CTX.size
        if got_alphabet != alphabet:
            raise CodecError(f"context alphabet {got_alphabet}, expected {alphabet}")
        end = pos + 2 * alphabet + 4 * nwords
        if end > len(view):
            raise CodecError("range-coded symbols are truncated")
        table = np.frombuffer(view[pos : pos + 2 * alphabet], dtype="<u2")
        words = np.frombuffer(view[pos + 2 * alphabet : end], dtype="<u4").astype(np.uint32)
        pos = end
        n = stop - start
        if not n:
            continue
        if not table.any():
            raise CodecError("range-coded context has an empty model")
        model = constriction.stream.model.Categorical(table.astype(np.float32), perfect=False)
        try:
            dec = constriction.stream.queue.RangeDecoder(words)
            sym = dec.decode(model, n)
        except Exception as exc:
            raise CodecError(f"range decoder failed: {exc}") from exc
        out[start:stop] = sym
    if pos != len(view):
        raise CodecError("range-coded symbols have trailing bytes")
