"""The backend-protocol reference embedded in ``docs/plugins/backend-protocol.md``.

The page shows the declarations of :mod:`lmcache_core.interface` as they are in the
source (a test fails when the page differs). Regenerate with
``python -m lmcache_core.interface_docs docs/plugins/backend-protocol.md``.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from . import interface
from .tables import markdown_table

__all__ = ["BEGIN", "END", "interface_markdown", "render_interface_block"]

BEGIN = "<!-- lmcache-core:interface -->"
END = "<!-- /lmcache-core:interface -->"

_ALIASES = ("ProgressCallback", "EvictionListener", "VictimSelector")
_DATA = (interface.Capabilities, interface.EntryInfo)


def _alias_source(name: str) -> str:
    """``name = ...`` in the module's source, with the ``#:`` comment lines above it."""
    lines = inspect.getsource(interface).splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"{name} = "):
            start = i
            while start > 0 and lines[start - 1].startswith("#:"):
                start -= 1
            return "\n".join(lines[start : i + 1]) + "\n"
    raise LookupError(name)  # pragma: no cover - the names above exist


def _code(src: str) -> str:
    return f"```python\n{src.rstrip()}\n```\n"


def interface_markdown() -> str:
    """Markdown of the declared interface: version, required protocol, optional ones."""
    out = [
        f"Backend interface **{interface.INTERFACE_VERSION}**; this lmcache-core loads "
        f"backends that declare {interface.supported_interface_range()}.\n",
        "\n### Required: `StorageBackend`\n\n",
        _code(inspect.getsource(interface.StorageBackend)),
        "\n### Optional capabilities\n\n",
    ]
    rows = []
    for proto, words in interface.OPTIONAL_PROTOCOLS.items():
        methods = ", ".join(f"`{m}`" for m in interface.missing_members(object(), proto))
        rows.append([f"[`{proto.__name__}`](#{proto.__name__.lower()})", methods, words])
    out.append(markdown_table(rows, ["Protocol", "Methods", "Shown by `backends` as"]))
    for proto in interface.OPTIONAL_PROTOCOLS:
        out.append(f"\n#### `{proto.__name__}`\n\n")
        out.append(_code(inspect.getsource(proto)))
    out.append("\n### Data types and callbacks\n\n")
    src = "\n\n".join(inspect.getsource(c).rstrip() for c in _DATA)
    src += "\n\n\n" + "\n".join(_alias_source(a) for a in _ALIASES)
    out.append(_code(src))
    return "".join(out)


def render_interface_block(text: str) -> str:
    """``text`` with the block between the markers replaced by :func:`interface_markdown`."""
    begin = text.find(BEGIN)
    end = text.find(END)
    if begin < 0 or end < begin:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return text[: begin + len(BEGIN)] + "\n" + interface_markdown() + text[end:]


def main(argv: list[str]) -> int:
    """Rewrite the interface block of each file in ``argv``."""
    for name in argv:
        path = Path(name)
        text = path.read_text(encoding="utf-8")
        new = render_interface_block(text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(f"updated {name}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
