"""The cached header skeletons produce exactly the bytes of a full JSON encoding."""

from __future__ import annotations

import random

import pytest
import torch
from lmcache_backend_disk import objects

from lmcache_core import format as fmt

_FIELD = b'"checksum":"xxh3_128:'


def _keys() -> list[str]:
    rnd = random.Random(11)
    keys = [
        "",
        "m@1@0@abc@bfloat16",
        'quote"back\\slash\nnew\x00nul\x1fus\u2028ls\u00e9\U0001f600',
        '"checksum":"xxh3_128:' + "0" * 32,  # the field's text inside the key is escaped
        '"key":"x',
    ]
    keys += ["k" * n for n in range(3900, 4110, 7)]  # headers of one and two blocks
    keys += ["x" * 9000]
    for _ in range(60):
        n = rnd.randrange(0, 200)
        keys.append(
            "".join(
                chr(rnd.choice((rnd.randrange(0, 128), rnd.randrange(128, 0xD7FF))))
                for _ in range(n)
            )
        )
    return keys


@pytest.mark.parametrize(
    ("ns", "dtype", "shape", "codec"),
    [
        ('{"model_name":"m"}', torch.bfloat16, (2, 8, 256, 128), "raw"),
        ('{"model_name":"q\\"uo\u00e9"}', torch.uint8, (4 << 20,), "lossless:zstd"),
        ("", torch.float32, (), "raw"),
    ],
)
def test_cached_template_equals_full_encoding(
    ns: str, dtype: torch.dtype, shape: tuple[int, ...], codec: str
) -> None:
    for key in _keys():
        t = objects.HeaderTemplate(key, ns, dtype, shape, codec)
        expected = fmt.encode_header(key, ns, dtype, shape, objects._DUMMY_CHECKSUM, codec)
        assert t.bytes == expected, key
        assert t.digits_at == expected.index(_FIELD) + len(_FIELD)
        digits = "0123456789abcdef" * 2
        assert t.with_digits(digits) == fmt.encode_header(
            key, ns, dtype, shape, "xxh3_128:" + digits, codec
        )
        assert t.digits_of(t.with_digits(digits)) == digits


def test_a_surrogate_key_fails_like_the_full_encoding() -> None:
    with pytest.raises(UnicodeEncodeError):
        fmt.encode_header("a\ud800", "", torch.uint8, (1,), objects._DUMMY_CHECKSUM)
    with pytest.raises(UnicodeEncodeError):
        objects.HeaderTemplate("a\ud800", "", torch.uint8, (1,))
