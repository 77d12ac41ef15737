"""The lossless codec against the codec contract, for every compressor it offers."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from lmcache_codec_lossless.codec import LosslessCodec

from lmcache_core.codecs import CodecError
from lmcache_core.testing.codecs import CodecContract, kv_like


class TestLosslessDefault(CodecContract):
    name = "lossless"
    options: ClassVar[dict[str, Any]] = {}


class TestLosslessBlosc2Zstd(CodecContract):
    name = "lossless"
    options: ClassVar[dict[str, Any]] = {"compressor": "blosc2-zstd", "level": 3, "shuffle": "bit"}


class TestLosslessZstd(CodecContract):
    name = "lossless"
    options: ClassVar[dict[str, Any]] = {"compressor": "zstd", "level": 1}


class TestLosslessLz4(CodecContract):
    name = "lossless"
    options: ClassVar[dict[str, Any]] = {"compressor": "lz4"}
    allocates_output = True  # python-lz4 has no decompress-into (documented)


def test_shuffle_is_what_makes_float_kv_compress() -> None:
    x = kv_like((2, 2, 4, 32, 128), torch.bfloat16)
    shuffled = len(LosslessCodec(shuffle="byte").encode(x))
    plain = len(LosslessCodec(shuffle="none").encode(x))
    assert shuffled < plain < x.nbytes + 4096


@pytest.mark.parametrize(
    "kwargs",
    [
        {"compressor": "gzip"},
        {"shuffle": "bit", "compressor": "zstd"},
        {"level": 12},
        {"threads": 0},
    ],
)
def test_bad_options_raise(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LosslessCodec(**kwargs)


def test_other_options_stream_is_refused_or_exact() -> None:
    """A stream compressed by zstd cannot be read by the blosc2 codec (a miss, never garbage)."""
    x = kv_like((2, 1, 2, 32, 16))
    buf = bytes(LosslessCodec(compressor="zstd").encode(x))
    with pytest.raises(CodecError):
        LosslessCodec().decode_into(buf, torch.empty_like(x))
