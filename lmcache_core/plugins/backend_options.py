"""Backend option schemas: validation for the config code, descriptions for the CLI and docs.

Every backend class declares ``Options``, a frozen dataclass made with
:func:`lmcache_core.config.options.option`. Validation, ``lmcache-core backends`` and the option
tables in the docs all come from that one declaration.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

from ..config.options import build_options, describe_options
from ..errors import PluginError
from ..tables import markdown_table
from .registry import BackendSpec

__all__ = [
    "OPTIONS_BLOCK_RE",
    "backend_options_class",
    "describe_backend_options",
    "options_blocks",
    "options_markdown",
    "render_options_blocks",
    "validate_backend_options",
]


def backend_options_class(backend: BackendSpec | type[Any]) -> type[Any]:
    """The ``Options`` dataclass of a backend class or registered spec (imports the class)."""
    cls = backend.load() if isinstance(backend, BackendSpec) else backend
    opts = getattr(cls, "Options", None)
    if not (isinstance(opts, type) and dataclasses.is_dataclass(opts)):
        raise PluginError(
            f"backend class {cls.__module__}.{cls.__qualname__} declares no Options dataclass "
            "(every backend needs `Options = <dataclass made with lmcache_core.config.options.option>`)"
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


def options_markdown(backend: BackendSpec | type[Any]) -> str:
    """A Markdown table of the backend's options (what the docs embed)."""
    rows = []
    for o in describe_backend_options(backend):
        kind = o["type"] + (f" ({', '.join(o['choices'])})" if o["choices"] else "")
        default = o["default_text"]
        rows.append([f"`{o['name']}`", kind, f"`{default}`" if default else "", o["doc"]])
    return markdown_table(rows, ["Option", "Type", "Default", "Description"])


# --------------------------------------------------------------------------- docs blocks
#: Docs embed a backend's option table between these markers; ``lmcache-core backends
#: --write-docs FILE`` regenerates the block and a test fails when one is stale.
OPTIONS_BLOCK_RE = re.compile(
    r"(?P<open>^<!-- lmcache-core:options (?P<name>[A-Za-z0-9_.-]+) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close>^<!-- /lmcache-core:options -->)",
    re.DOTALL | re.MULTILINE,
)


_FENCE_RE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)


def _prose_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of the parts of ``text`` outside fenced code blocks."""
    spans, pos = [], 0
    for m in _FENCE_RE.finditer(text):
        spans.append((pos, m.start()))
        pos = m.end()
    spans.append((pos, len(text)))
    return spans


def options_blocks(text: str) -> dict[str, str]:
    """Backend name to the option table embedded in ``text`` (code examples excluded)."""
    return {
        m["name"]: m["body"]
        for start, end in _prose_spans(text)
        for m in OPTIONS_BLOCK_RE.finditer(text[start:end])
    }


def render_options_blocks(text: str, resolve: Callable[[str], BackendSpec | type[Any]]) -> str:
    """``text`` with every embedded option table regenerated (``resolve``: name to backend)."""

    def fill(m: re.Match[str]) -> str:
        return f"{m['open']}{options_markdown(resolve(m['name']))}{m['close']}"

    out, pos = [], 0
    for start, end in _prose_spans(text):
        out.append(text[pos:start])
        out.append(OPTIONS_BLOCK_RE.sub(fill, text[start:end]))
        pos = end
    out.append(text[pos:])
    return "".join(out)
