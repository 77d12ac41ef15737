"""Typed backend options.

Every backend declares its options as a frozen dataclass whose fields are made with
:func:`option`; :func:`build_options` validates a mapping (from YAML/JSON/a dict) against
it, with errors that carry the option path. The CLI listing and the docs' option tables
are generated from the same declarations (:func:`describe_options`), so they cannot drift.

Field kinds: ``int``, ``float``, ``bool``, ``str``, ``bytes`` (an int accepting ``"8GiB"``),
``path`` (a str, ``~`` expanded), and ``str`` with ``choices``. ``Optional`` fields accept
``None``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

from ..errors import ConfigError, SizeFormatError
from ..redaction import REDACTED, redact_url, url_password
from ..sizes import format_bytes, parse_bytes

__all__ = [
    "INT_RANGE",
    "REDACTED",
    "HiddenText",
    "URLText",
    "build_options",
    "describe_options",
    "option",
    "shown",
]

T = TypeVar("T")
_KINDS = ("int", "float", "bool", "str", "bytes", "path", "secret", "dict", "list")
#: Bounds every ``int`` option has unless it declares tighter ones (a signed 64-bit
#: integer: larger values overflow the C code they reach).
INT_RANGE = (-(2**63), 2**63 - 1)
_MAX_INT_TEXT = 40  # digits of an int given as text


class HiddenText(str):
    """A text option whose ``repr()`` hides it: a secret, or a value read from ``$env``.

    It is a ``str`` (equal to, and used as, the value itself); only ``repr()`` (and so the
    ``repr()`` of the Options holding it) shows ``'<redacted>'``.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(REDACTED)


class URLText(str):
    """A text option holding a URL with a password: ``repr()`` shows it redacted."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(redact_url(str(self)))


def shown(value: Any, kind: str = "") -> str:
    """``repr(value)`` for an error message: short, huge ints not spelled out, secrets hidden."""
    if kind == "secret":
        return REDACTED
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<a {value.bit_length()}-bit integer>"
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__, or an int too large to print
        return f"<a {type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


def option(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    kind: str | None = None,
    choices: Sequence[str] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    nullable: bool = False,
) -> Any:
    """Declare one option field: its default, a one-line description and its kind.

    ``kind`` defaults to the type of ``default``. ``bytes`` defaults may be given as text
    (``"1GiB"``). A field without a default is required.
    """
    if kind is None:
        if default is dataclasses.MISSING or default is None:
            raise TypeError("option() needs kind= when there is no default value")
        kind = {bool: "bool", int: "int", float: "float", str: "str"}.get(type(default), "str")
    if kind not in _KINDS:
        raise TypeError(f"unknown option kind {kind!r}")
    if kind == "bytes" and isinstance(default, str):
        default = parse_bytes(default)
    meta = {
        "doc": doc,
        "kind": kind,
        "choices": tuple(choices) if choices else None,
        "minimum": minimum,
        "maximum": maximum,
        "nullable": nullable or default is None,
    }
    show = kind != "secret"  # a secret never appears in the Options' repr()
    if isinstance(default, (dict, list)):
        factory = lambda d=default: type(d)(d)  # noqa: E731
        return dataclasses.field(default_factory=factory, metadata=meta, repr=show)
    return dataclasses.field(default=default, metadata=meta, repr=show)


def _coerce(
    name: str, value: Any, meta: Mapping[str, Any], path: str, hidden: Collection[str] = ()
) -> Any:
    where = f"{path}.{name}" if path else name
    if meta["kind"] != "secret" and where not in hidden:
        out = _coerce_value(value, meta, where)
        if isinstance(out, str) and "://" in out and url_password(out):
            return URLText(out)
        return out
    error = None
    try:
        out = _coerce_value(value, meta, where)
        return HiddenText(out) if isinstance(out, str) else out
    except ConfigError as exc:  # say why, without the value
        reason = exc.reason.replace(shown(value), REDACTED)
        if isinstance(value, str) and len(value) >= 3:
            reason = reason.replace(value, REDACTED)
        if where in hidden:
            reason += " (value from $env, not shown)"
        error = ConfigError(reason, where)
    raise error  # outside the handler: the original (which quotes it) is not its context


def _coerce_value(value: Any, meta: Mapping[str, Any], where: str) -> Any:
    kind = meta["kind"]
    if value is None:
        if meta["nullable"]:
            return None
        raise ConfigError("must not be null", where)
    try:
        out = _convert(kind, value, where)
    except SizeFormatError as exc:
        raise ConfigError(str(exc) if kind != "secret" else "invalid byte size", where) from None
    except (ValueError, OverflowError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"invalid {kind} {shown(value, kind)}", where) from None
    choices = meta.get("choices")
    if choices and out not in choices:
        raise ConfigError(f"must be one of {list(choices)}, got {shown(out, kind)}", where)
    lo, hi = meta.get("minimum"), meta.get("maximum")
    if kind in ("int", "bytes"):
        lo = INT_RANGE[0] if lo is None else max(lo, INT_RANGE[0])
        hi = INT_RANGE[1] if hi is None else min(hi, INT_RANGE[1])
    if lo is not None and out < lo:
        raise ConfigError(f"must be >= {lo}, got {shown(out, kind)}", where)
    if hi is not None and out > hi:
        raise ConfigError(f"must be <= {hi}, got {shown(out, kind)}", where)
    return out


def _convert(kind: str, value: Any, where: str) -> Any:
    """``value`` as an option of ``kind`` (raises ConfigError, ValueError or OverflowError)."""
    if kind == "bytes":
        return parse_bytes(value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _BOOL_TEXT:
            return _BOOL_TEXT[value.lower()]
        raise ConfigError(f"expected true or false, got {shown(value)}", where)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ConfigError(f"expected an integer, got {shown(value)}", where)
        if isinstance(value, str) and len(value.strip()) > _MAX_INT_TEXT:
            raise ConfigError(f"integer {shown(value)} is too long", where)
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"expected a number, got {shown(value)}", where)
        if isinstance(value, str) and len(value.strip()) > _MAX_INT_TEXT:
            raise ConfigError(f"number {shown(value)} is too long", where)
        out = float(value)
        if not math.isfinite(out):
            raise ConfigError(f"must be a finite number, got {shown(value)}", where)
        return out
    if kind in ("str", "secret"):
        if not isinstance(value, str):
            raise ConfigError(f"expected a string, got {type(value).__name__}", where)
        return value
    if kind == "path":
        if not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"expected a path string, got {type(value).__name__}", where)
        out_path = os.path.expanduser(os.fspath(value))
        if not out_path:
            raise ConfigError("path must not be empty", where)
        if "\0" in out_path:
            raise ConfigError("path must not contain a NUL character", where)
        return out_path
    if kind == "dict":
        if not isinstance(value, Mapping):
            raise ConfigError(f"expected a mapping, got {type(value).__name__}", where)
        return dict(value)
    if kind == "list":
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected a list, got {type(value).__name__}", where)
        return list(value)
    raise AssertionError(kind)  # pragma: no cover - guarded in option()


_BOOL_TEXT = {
    **dict.fromkeys(("true", "yes", "on", "1"), True),
    **dict.fromkeys(("false", "no", "off", "0"), False),
}


def build_options(
    cls: type[T], values: Any = None, path: str = "options", hidden: Collection[str] = ()
) -> T:
    """Validate ``values`` (a mapping, an instance of ``cls`` or ``None``) into ``cls``.

    Unknown names, wrong types and out-of-range values raise
    :class:`~lmcache_core.errors.ConfigError` naming ``path.option``. The value of an
    option of kind ``secret``, or whose path is in ``hidden`` (values read from the
    environment), never appears in the message.
    """
    if values is None:
        values = {}
    if isinstance(values, cls):
        return values
    if not isinstance(values, Mapping):
        raise ConfigError(f"expected a mapping of options, got {type(values).__name__}", path)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(
        (k if isinstance(k, str) else shown(k))[:100] for k in values if k not in fields
    )
    if unknown:
        first = unknown[0]
        close = difflib.get_close_matches(first, list(fields), n=1)
        msg = "unknown option" + (f"; did you mean {close[0]!r}?" if close else "")
        if len(unknown) > 1:
            msg += f" (also unknown: {', '.join(repr(u) for u in unknown[1:])})"
        raise ConfigError(f"{msg} (known: {', '.join(sorted(fields))})", _join(path, first))
    kwargs = {}
    for name, f in fields.items():
        if name in values:
            kwargs[name] = _coerce(name, values[name], f.metadata, path, hidden)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError("required option is missing", f"{path}.{name}" if path else name)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc), path) from exc


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def describe_options(cls: type[Any]) -> list[dict[str, Any]]:
    """One dict per option: name, kind, default (JSON-friendly), doc, choices, required."""
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required:
            default: Any = None
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc,operator]
        kind = meta.get("kind", "str")
        shown = format_bytes(default) if kind == "bytes" and isinstance(default, int) else default
        out.append(
            {
                "name": f.name,
                "type": kind,
                "default": default,
                "default_text": "(required)"
                if required
                else ("" if default is None else str(shown)),
                "required": required,
                "doc": meta.get("doc", ""),
                "choices": list(meta["choices"]) if meta.get("choices") else None,
            }
        )
    return out
