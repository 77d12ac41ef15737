"""Parsing and formatting of byte sizes (``"8GiB"``, ``"512 MB"``, ``4096``)."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from .errors import SizeFormatError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([a-zA-Z]{0,8})\s*$")
#: Largest byte size accepted (what a signed 64-bit size field holds).
MAX_BYTES = 2**63 - 1


def _checked(n: int, value: object) -> int:
    if n > MAX_BYTES:
        raise SizeFormatError(f"byte size {_shown(value)} is too large (at most 2**63-1 bytes)")
    return n


def _shown(value: object) -> str:
    """``repr(value)`` short enough for an error message (a huge int is not spelled out)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"<a {value.bit_length()}-bit integer>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_bytes(value: int | float | str) -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts non-negative ints, and strings such as ``"8GiB"``, ``"512 MB"``, ``"1.5GiB"``
    (decimal units are powers of 1000, binary ``*iB`` units powers of 1024). Raises
    :class:`SizeFormatError` with the offending text otherwise.
    """
    if isinstance(value, bool):
        raise SizeFormatError(f"expected a byte size, got a boolean {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise SizeFormatError(f"byte size must be >= 0, got {_shown(value)}")
        return _checked(value, value)
    if isinstance(value, float):
        if not (value >= 0 and math.isfinite(value)):
            raise SizeFormatError(f"byte size must be a finite number >= 0, got {value}")
        return _checked(int(value), value)
    if not isinstance(value, str):
        raise SizeFormatError(f"expected a byte size like '8GiB', got {type(value).__name__}")
    m = _SIZE_RE.match(value)
    if not m:
        raise SizeFormatError(
            f"cannot parse byte size {_shown(value)} (examples: 4096, '8GiB', '512MB')"
        )
    number, unit = m.group(1), m.group(2).lower()
    if unit not in _UNITS:
        known = ", ".join(u for u in ("KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB"))
        raise SizeFormatError(
            f"unknown unit {m.group(2)!r} in byte size {_shown(value)} (known: {known})"
        )
    return _checked(int(Fraction(number) * _UNITS[unit]), value)


def format_bytes(n: int | float) -> str:
    """Human-readable binary size, e.g. ``format_bytes(3 * 2**20) == '3.0 MiB'``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
