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
import os
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from .errors import ConfigError, SizeFormatError
from .sizes import format_bytes, parse_bytes

__all__ = ["build_options", "describe_options", "option"]

T = TypeVar("T")
_KINDS = ("int", "float", "bool", "str", "bytes", "path", "secret", "dict", "list")


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
    if isinstance(default, (dict, list)):
        factory = lambda d=default: type(d)(d)  # noqa: E731
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _coerce(name: str, value: Any, meta: Mapping[str, Any], path: str) -> Any:
    kind = meta["kind"]
    where = f"{path}.{name}" if path else name
    if value is None:
        if meta["nullable"]:
            return None
        raise ConfigError("must not be null", where)
    try:
        if kind == "bytes":
            out: Any = parse_bytes(value)
        elif kind == "bool":
            if isinstance(value, bool):
                out = value
            elif isinstance(value, str) and value.lower() in (
                "true",
                "yes",
                "on",
                "1",
                "false",
                "no",
                "off",
                "0",
            ):
                out = value.lower() in ("true", "yes", "on", "1")
            else:
                raise ConfigError(f"expected true or false, got {value!r}", where)
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ConfigError(f"expected an integer, got {value!r}", where)
            out = int(value)
        elif kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ConfigError(f"expected a number, got {value!r}", where)
            out = float(value)
        elif kind in ("str", "secret"):
            if not isinstance(value, str):
                raise ConfigError(f"expected a string, got {type(value).__name__}", where)
            out = value
        elif kind == "path":
            if not isinstance(value, (str, os.PathLike)):
                raise ConfigError(f"expected a path string, got {type(value).__name__}", where)
            out = os.path.expanduser(os.fspath(value))
            if not out:
                raise ConfigError("path must not be empty", where)
        elif kind == "dict":
            if not isinstance(value, Mapping):
                raise ConfigError(f"expected a mapping, got {type(value).__name__}", where)
            out = dict(value)
        elif kind == "list":
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"expected a list, got {type(value).__name__}", where)
            out = list(value)
        else:  # pragma: no cover - guarded in option()
            raise AssertionError(kind)
    except SizeFormatError as exc:
        raise ConfigError(str(exc), where) from exc
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"invalid {kind} {value!r}", where) from exc
    choices = meta.get("choices")
    if choices and out not in choices:
        raise ConfigError(f"must be one of {list(choices)}, got {out!r}", where)
    lo, hi = meta.get("minimum"), meta.get("maximum")
    if lo is not None and out < lo:
        raise ConfigError(f"must be >= {lo}, got {out!r}", where)
    if hi is not None and out > hi:
        raise ConfigError(f"must be <= {hi}, got {out!r}", where)
    return out


def build_options(cls: type[T], values: Any = None, path: str = "options") -> T:
    """Validate ``values`` (a mapping, an instance of ``cls`` or ``None``) into ``cls``.

    Unknown names, wrong types and out-of-range values raise
    :class:`~lmcache_core.errors.ConfigError` naming ``path.option``.
    """
    if values is None:
        values = {}
    if isinstance(values, cls):
        return values
    if not isinstance(values, Mapping):
        raise ConfigError(f"expected a mapping of options, got {type(values).__name__}", path)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown option(s) {unknown}; known: {sorted(fields)}",
            path,
        )
    kwargs = {}
    for name, f in fields.items():
        if name in values:
            kwargs[name] = _coerce(name, values[name], f.metadata, path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError("required option is missing", f"{path}.{name}" if path else name)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc), path) from exc


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
