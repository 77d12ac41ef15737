"""The plugin docs cannot drift: every hook is documented with its exact signature, and every
option table embedded in the repository's Markdown matches the backend's ``Options``."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from lmcache_core.backends.cpu import CPUBackend
from lmcache_core.plugins import get_registry, hookspecs
from lmcache_core.plugins.backend_options import (
    _prose_spans,
    options_blocks,
    options_markdown,
    render_options_blocks,
)
from lmcache_core.plugins.loader import new_plugin_manager

ROOT = Path(__file__).resolve().parents[1]
HOOKS_MD = ROOT / "docs" / "plugins" / "hooks.md"


def hookspec_functions() -> dict[str, object]:
    """The functions pluggy treats as hook specifications in the hookspec module."""
    marker = f"{hookspecs.PROJECT_NAME}_spec"
    found = {
        name: fn
        for name, fn in vars(hookspecs).items()
        if inspect.isfunction(fn) and hasattr(fn, marker)
    }
    # cross-check with pluggy's own view of the module
    pm_hooks = {n for n in vars(new_plugin_manager().hook) if not n.startswith("_")}
    assert set(found) == pm_hooks
    return found


def signature_line(name: str, fn: object) -> str:
    """``def name(arg: Annotation, ...) -> Return`` as written in the source."""
    sig = inspect.signature(fn)  # annotations are strings (postponed evaluation)
    params = []
    for p in sig.parameters.values():
        text = p.name if p.annotation is p.empty else f"{p.name}: {p.annotation}"
        if p.default is not p.empty:
            text += f" = {p.default!r}"
        params.append(text)
    ret = "" if sig.return_annotation is sig.empty else f" -> {sig.return_annotation}"
    return f"def {name}({', '.join(params)}){ret}"


def test_there_are_hooks():
    assert "lmcache_register_backends" in hookspec_functions()


@pytest.mark.parametrize("name", sorted(hookspec_functions()))
def test_every_hook_is_documented_with_its_exact_signature(name):
    text = HOOKS_MD.read_text()
    expected = signature_line(name, hookspec_functions()[name])
    assert f"## `{name}`" in text, f"{name} has no section in {HOOKS_MD}"
    code_lines = {line.strip().rstrip(":") for line in text.splitlines()}
    assert expected in code_lines, f"{HOOKS_MD} must show the signature:\n    {expected}"


def test_no_stale_hook_is_documented():
    text = HOOKS_MD.read_text()
    documented = set(re.findall(r"^## `(lmcache_\w+)`", text, re.MULTILINE))
    documented |= set(re.findall(r"^def (lmcache_\w+)\(", text, re.MULTILINE))
    assert documented == set(hookspec_functions())


def test_signature_line_is_the_real_one():
    # guards the helper itself: it must see the parameter and return annotations
    line = signature_line("lmcache_register_backends", hookspecs.lmcache_register_backends)
    assert line == "def lmcache_register_backends(registry: BackendRegistry) -> None"


def all_markdown() -> list[Path]:
    pats = ["README.md", "docs/**/*.md", "backends/*/README.md", "plugins/*/README.md"]
    return sorted({p for pat in pats for p in ROOT.glob(pat)})


def markdown_files() -> list[Path]:
    """Markdown files of the repository that embed option tables of installed backends
    (the template's, not installed, is checked by test_tutorial.py)."""
    template = ROOT / "backends" / "_template"
    return [
        p
        for p in all_markdown()
        if options_blocks(p.read_text()) and not p.is_relative_to(template)
    ]


def test_option_markers_are_well_formed():
    for path in all_markdown():
        text = path.read_text()
        opened = sum(
            len(re.findall(r"^<!-- lmcache-core:options ", text[a:b], re.MULTILINE))
            for a, b in _prose_spans(text)
        )
        assert opened == len(options_blocks(text)), f"{path}: unmatched options markers"


def test_render_options_blocks_regenerates_stale_tables_only_in_prose():
    stale = "<!-- lmcache-core:options cpu -->\n| old |\n<!-- /lmcache-core:options -->"
    text = f"intro\n{stale}\n\n```markdown\n{stale}\n```\n"
    out = render_options_blocks(text, {"cpu": CPUBackend}.__getitem__)
    assert options_blocks(out) == {"cpu": options_markdown(CPUBackend)}
    assert out.endswith(f"```markdown\n{stale}\n```\n")  # the code example is untouched
    assert render_options_blocks(out, {"cpu": CPUBackend}.__getitem__) == out


def test_the_cli_doc_embeds_the_cpu_options():
    assert ROOT / "docs" / "plugins" / "cli.md" in markdown_files()


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_embedded_option_tables_are_current(path):
    registry = get_registry()
    blocks = options_blocks(path.read_text())
    for name, body in blocks.items():
        assert name in registry, (
            f"{path} embeds options of {name!r}, which is not registered here: "
            f"{registry.unknown_message(name)}"
        )
        assert body == options_markdown(registry.get(name)), (
            f"{path}: the options table of {name!r} is stale; run "
            f"`lmcache-core backends --write-docs {path.relative_to(ROOT)}`"
        )
