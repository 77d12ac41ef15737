"""The object format: safetensors-compatible, 4 KiB data offset, checksummed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from lmcache_core import BufferMismatchError, CacheEngineKey, FormatError, Namespace
from lmcache_core import format as fmt
from lmcache_core.testing import random_tensor, same_bits

KEY = CacheEngineKey("model", 1, 0, 0x1234, "bfloat16")
NS = Namespace(model_name="model", chunk_size=256)


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((2, 3, 5), torch.bfloat16),
        ((4096,), torch.float16),
        ((), torch.float32),
        ((0,), torch.int8),
        ((7, 1), torch.int64),
        ((3,), torch.bool),
    ],
)
def test_round_trip_and_safetensors_compatibility(
    tmp_path: Path, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    value = random_tensor(shape, dtype, seed=1)
    blob = fmt.encode(KEY, NS, value)
    header = fmt.decode_header(blob, total_size=len(blob))
    assert header.data_offset % fmt.DATA_ALIGN == 0
    assert header.data_offset == 4096
    assert header.key == KEY.to_string()
    assert Namespace.from_json(header.namespace) == NS
    assert header.checksum.startswith("xxh3_128:")
    assert header.codec == "raw"
    out = torch.empty(shape, dtype=dtype)
    fmt.decode_into(blob, out, KEY, NS)
    assert same_bits(out, value)
    _, decoded = fmt.decode(blob, KEY, NS)
    assert same_bits(decoded, value)
    path = tmp_path / "obj.safetensors"
    path.write_bytes(bytes(blob))
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert meta["format"] == "lmcache-core" and meta["format_version"] == "1"
        assert meta["key"] == KEY.to_string()
        assert same_bits(f.get_tensor("kv"), value)


def test_encode_into_caller_buffer() -> None:
    value = random_tensor((1000,), torch.float16, seed=2)
    size = 4096 + value.numel() * 2
    buf = bytearray(size + 100)
    view = fmt.encode(KEY, NS, value, out=buf)
    assert len(view) == size
    assert bytes(view) == bytes(fmt.encode(KEY, NS, value))
    out_t = torch.empty(size, dtype=torch.uint8)
    fmt.encode(KEY, NS, value, out=out_t)
    assert bytes(out_t.numpy()) == bytes(view)
    with pytest.raises(BufferMismatchError):
        fmt.encode(KEY, NS, value, out=bytearray(10))
    with pytest.raises(BufferMismatchError):
        fmt.encode(KEY, NS, value, out=bytes(size))


def test_big_header_still_aligned() -> None:
    key = CacheEngineKey("m" * 5000, 1, 0, 1, "f")
    blob = fmt.encode(key, NS, torch.zeros(3))
    header = fmt.decode_header(blob)
    assert header.data_offset == 8192


def _blob() -> bytearray:
    return bytearray(fmt.encode(KEY, NS, random_tensor((512,), torch.float32, seed=3)))


def test_every_single_byte_flip_in_data_is_detected() -> None:
    blob = _blob()
    out = torch.empty(512, dtype=torch.float32)
    for pos in range(4096, len(blob), 97):
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        with pytest.raises(FormatError):
            fmt.decode_into(bad, out, KEY, NS)


def test_header_corruption_is_detected() -> None:
    blob = _blob()
    out = torch.empty(512, dtype=torch.float32)
    for pos in (0, 3, 7, 9, 20, 60):
        bad = bytearray(blob)
        bad[pos] ^= 0xFF
        with pytest.raises((FormatError, BufferMismatchError)):
            fmt.decode_into(bad, out, KEY, NS)


def test_truncation_is_detected() -> None:
    blob = _blob()
    out = torch.empty(512, dtype=torch.float32)
    for cut in (0, 4, 8, 100, 4095, 4096, len(blob) - 1):
        with pytest.raises(FormatError):
            fmt.decode_into(blob[:cut], out, KEY, NS)
    with pytest.raises(FormatError):
        fmt.decode_into(blob + b"x", out, KEY, NS)


def test_foreign_key_namespace_and_files() -> None:
    blob = _blob()
    out = torch.empty(512, dtype=torch.float32)
    with pytest.raises(FormatError):
        fmt.decode_into(blob, out, CacheEngineKey("model", 1, 0, 0x1235, "bfloat16"), NS)
    with pytest.raises(FormatError):
        fmt.decode_into(blob, out, KEY, Namespace(model_name="other"))
    with pytest.raises(BufferMismatchError):
        fmt.decode_into(blob, torch.empty(511, dtype=torch.float32), KEY, NS)
    # a plain safetensors file that is not ours
    body = json.dumps({"kv": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    foreign = struct.pack("<Q", len(body)) + body + b"\0\0\0\0"
    with pytest.raises(FormatError):
        fmt.decode_into(foreign, torch.empty(1), None, None)
    # wrong version
    meta_blob = bytes(blob).replace(b'"format_version":"1"', b'"format_version":"9"')
    with pytest.raises(FormatError):
        fmt.decode_into(meta_blob, out, KEY, NS)
