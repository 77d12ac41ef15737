"""Typed options, sizes and their errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lmcache_core import ConfigError, format_bytes, parse_bytes
from lmcache_core.config.options import build_options, describe_options, option
from lmcache_core.errors import SizeFormatError


@dataclass(frozen=True)
class Opts:
    path: str = option(kind="path", doc="where")
    size: int = option("1GiB", kind="bytes", doc="how much", minimum=1)
    mode: str = option("fast", doc="how", choices=("fast", "safe"))
    flag: bool = option(False, doc="whether")
    ratio: float = option(0.5, doc="a number", minimum=0.0, maximum=1.0)
    secret: str | None = option(None, kind="secret", doc="a secret")


def test_valid_options_are_coerced() -> None:
    o = build_options(Opts, {"path": "~/x", "size": "2 MiB", "flag": "yes", "ratio": 1})
    assert o.path.endswith("/x") and not o.path.startswith("~")
    assert o.size == 2 << 20 and o.flag is True and o.ratio == 1.0 and o.secret is None


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({}, "opts.path"),
        ({"path": "p", "size": "lots"}, "opts.size"),
        ({"path": "p", "size": 0}, "opts.size"),
        ({"path": "p", "mode": "slow"}, "opts.mode"),
        ({"path": "p", "flag": "maybe"}, "opts.flag"),
        ({"path": "p", "ratio": 2}, "opts.ratio"),
        ({"path": "p", "ratio": "x"}, "opts.ratio"),
        ({"path": "p", "colour": 1}, "opts.colour"),
        ({"path": 5}, "opts.path"),
    ],
)
def test_errors_carry_the_option_path(values: dict[str, object], where: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_options(Opts, values, path="opts")
    assert info.value.path == where
    assert str(info.value).startswith(where)


def test_describe_options() -> None:
    rows = {r["name"]: r for r in describe_options(Opts)}
    assert rows["path"]["required"] and rows["path"]["type"] == "path"
    assert rows["size"]["default"] == 1 << 30 and rows["size"]["default_text"] == "1.0 GiB"
    assert rows["mode"]["choices"] == ["fast", "safe"]
    assert all(r["doc"] for r in rows.values())


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("8GiB", 8 << 30),
        ("512 MB", 512_000_000),
        ("1.5KiB", 1536),
        (7, 7),
        ("2k", 2000),
        ("3 tib", 3 << 40),
    ],
)
def test_parse_bytes(text: object, value: int) -> None:
    assert parse_bytes(text) == value  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "GiB", "1.2.3GiB", "-1", "8 parsecs", True, None, [1]])
def test_parse_bytes_rejects(bad: object) -> None:
    with pytest.raises(SizeFormatError):
        parse_bytes(bad)  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(3 << 20) == "3.0 MiB"
    assert format_bytes(12) == "12 B"
