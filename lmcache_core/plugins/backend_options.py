"""Backend option schemas: validation for the config code, descriptions for the CLI and docs.

Every backend class declares ``Options``, a frozen dataclass made with
:func:`lmcache_core.options.option`. Validation, ``lmcache-core backends`` and the option
tables in the docs all come from that one declaration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..errors import PluginError
from ..options import build_options, describe_options
from .registry import BackendSpec

__all__ = [
    "backend_options_class",
    "describe_backend_options",
    "options_markdown",
    "validate_backend_options",
]


def backend_options_class(backend: BackendSpec | type[Any]) -> type[Any]:
    """The ``Options`` dataclass of a backend class or registered spec (imports the class)."""
    cls = backend.load() if isinstance(backend, BackendSpec) else backend
    opts = getattr(cls, "Options", None)
    if not (isinstance(opts, type) and dataclasses.is_dataclass(opts)):
        raise PluginError(
            f"backend class {cls.__module__}.{cls.__qualname__} declares no Options dataclass "
            "(every backend needs `Options = <dataclass made with lmcache_core.options.option>`)"
        )
    return opts


def validate_backend_options(
    backend: BackendSpec | type[Any], values: Mapping[str, Any] | Any = None, path: str = "options"
) -> Any:
    """Validate ``values`` against the backend's ``Options`` and return the typed options.

    ``path`` is where the mapping sits in the configuration (``tiers[1].options``);
    :class:`~lmcache_core.errors.ConfigError` names ``path.option`` on a bad value.
    """
    return build_options(backend_options_class(backend), values, path)


def describe_backend_options(backend: BackendSpec | type[Any]) -> list[dict[str, Any]]:
    """One JSON-friendly dict per option (name, type, default, default_text, required, doc,
    choices)."""
    return describe_options(backend_options_class(backend))


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def options_markdown(backend: BackendSpec | type[Any]) -> str:
    """A Markdown table of the backend's options (what the docs embed)."""
    lines = ["| Option | Type | Default | Description |", "|---|---|---|---|"]
    for o in describe_backend_options(backend):
        kind = o["type"] + (f" ({', '.join(o['choices'])})" if o["choices"] else "")
        default = o["default_text"]
        lines.append(
            f"| `{o['name']}` | {_cell(kind)} | {_cell(f'`{default}`' if default else '')} "
            f"| {_cell(o['doc'])} |"
        )
    return "\n".join(lines) + "\n"
