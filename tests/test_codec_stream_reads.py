"""``lmcache_core.codecs.read_stream_into``: the exact-length stream read both the
lossless and the cachegen codec use for zstd frames."""

from __future__ import annotations

import io

import pytest
import zstandard

from lmcache_core.codecs import CodecError, read_stream_into


def test_fills_the_target_exactly() -> None:
    data = bytes(range(256)) * 40
    target = bytearray(len(data))
    read_stream_into(io.BytesIO(data), memoryview(target), "test stream")
    assert bytes(target) == data


@pytest.mark.parametrize("delta", [-1, 1])
def test_a_stream_of_another_length_is_refused(delta: int) -> None:
    data = b"x" * (1000 + delta)
    target = bytearray(1000)
    with pytest.raises(CodecError, match="test stream holds other than 1000 bytes"):
        read_stream_into(io.BytesIO(data), memoryview(target), "test stream")


def test_reads_a_zstd_frame_in_several_pieces() -> None:
    # larger than zstandard's read block, so readinto returns in pieces
    data = bytes(range(251)) * 4000
    frame = zstandard.ZstdCompressor(level=3).compress(data)
    target = bytearray(len(data))
    reader = zstandard.ZstdDecompressor().stream_reader(frame)
    read_stream_into(reader, memoryview(target), "zstd frame")
    assert bytes(target) == data
    short = bytearray(len(data) - 1)
    with pytest.raises(CodecError):
        read_stream_into(
            zstandard.ZstdDecompressor().stream_reader(frame), memoryview(short), "zstd frame"
        )
