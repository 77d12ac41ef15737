"""int8, int4 and fp8 against the codec contract, with their documented error bounds."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from lmcache_codec_quant.codec import Int8Codec

from lmcache_core.codecs import CodecError, KVCodec
from lmcache_core.testing.codecs import CodecContract, kv_like


def _groups(x: torch.Tensor, g: int) -> tuple[torch.Tensor, int]:
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % g
    if pad:
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    return flat.view(-1, g), n


def _int_bound(x: torch.Tensor, g: int, bits: int) -> torch.Tensor:
    if x.numel() == 0:
        return x
    v, n = _groups(x, g)
    mn, mx = v.amin(dim=1, keepdim=True), v.amax(dim=1, keepdim=True)
    step = (mx - mn) / ((1 << bits) - 1) * (1 + 2**-9)
    bound = step / 2 + mn.abs() * 2**-10 + 1e-6
    return bound.expand_as(v).reshape(-1)[:n].reshape(x.shape)


class TestInt8(CodecContract):
    name = "int8"
    options: ClassVar[dict[str, Any]] = {}

    def error_bound(self, codec: KVCodec, x: torch.Tensor) -> torch.Tensor:
        return _int_bound(x, codec.options()["group_size"], 8)


class TestInt8Group64(TestInt8):
    options: ClassVar[dict[str, Any]] = {"group_size": 64}


class TestInt4(CodecContract):
    name = "int4"
    options: ClassVar[dict[str, Any]] = {}

    def error_bound(self, codec: KVCodec, x: torch.Tensor) -> torch.Tensor:
        return _int_bound(x, codec.options()["group_size"], 4)


class TestFp8(CodecContract):
    name = "fp8"
    options: ClassVar[dict[str, Any]] = {}

    def error_bound(self, codec: KVCodec, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x
        v, n = _groups(x, codec.options()["group_size"])
        s = v.abs().amax(dim=1, keepdim=True) / 448 * (1 + 2**-7)
        bound = v.abs() * 2**-4 + s * 2**-9 + 1e-7
        return bound.reshape(-1)[:n].reshape(x.shape)


def test_int8_error_is_small_on_kv() -> None:
    """Mean int8 error under 1% of the values' spread on KV-like data."""
    x = kv_like((4, 2, 4, 32, 128))
    out = torch.empty_like(x)
    Int8Codec().decode_into(bytes(Int8Codec().encode(x)), out)
    assert (out - x).abs().mean() < 0.01 * x.std()


def test_wide_range_uses_float32_parameters() -> None:
    x = kv_like((4, 64)) * 1e5
    codec = Int8Codec()
    out = torch.empty_like(x)
    codec.decode_into(bytes(codec.encode(x)), out)
    bound = _int_bound(x, 32, 8)
    assert bool(((out - x).abs() <= bound + x.abs() * 1e-6).all())


def test_group_size_mismatch_is_a_codec_error() -> None:
    x = kv_like((4, 64))
    with pytest.raises(CodecError):
        Int8Codec(group_size=64).decode_into(bytes(Int8Codec().encode(x)), torch.empty_like(x))


@pytest.mark.parametrize(
    "cls_kwargs", [{"group_size": 1}, {"group_size": 5000}, {"group_size": 2.5}]
)
def test_bad_group_size(cls_kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Int8Codec(**cls_kwargs)
