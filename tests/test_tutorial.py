"""The backend tutorial shows the example package's real code, and the packages that are not
installed here (the example, the template) have current option tables.

In ``docs/plugins/tutorial-backend.md`` a code block after ``<!-- example: PATH -->`` is
the whole file PATH; the blocks after ``<!-- example-part: PATH -->`` are, in order, the
whole file (blank lines aside); the YAML after ``<!-- check: config -->`` validates with
the example's plugin registered.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import yaml

from lmcache_core.config import load_config
from lmcache_core.plugins import BackendRegistry, load_plugins
from lmcache_core.plugins.backend_options import options_blocks, options_markdown

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "plugins" / "tutorial-backend.md"
EXAMPLE = ROOT / "examples" / "lmcache-backend-sqlite"
#: Packages of this repository that `make venv` does not install: (folder, import package).
LOCAL_PACKAGES = [
    (EXAMPLE, "lmcache_backend_sqlite"),
    (ROOT / "backends" / "_template", "lmcache_backend_template"),
]

BLOCK_RE = re.compile(
    r"^<!-- (?P<kind>example|example-part|check): (?P<arg>\S+) -->\n"
    r"```[a-z]*\n(?P<body>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)


def blocks() -> list[tuple[str, str, str]]:
    return [(m["kind"], m["arg"], m["body"]) for m in BLOCK_RE.finditer(TUTORIAL.read_text())]


def no_blank_lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.strip()) + "\n"


def test_whole_files_are_the_example_files():
    whole = [(arg, body) for kind, arg, body in blocks() if kind == "example"]
    assert len(whole) >= 4
    for path, body in whole:
        assert body == (ROOT / path).read_text(), f"{TUTORIAL.name}: the block of {path} is stale"


def test_parts_in_order_make_the_whole_file():
    parts: dict[str, list[str]] = {}
    for kind, arg, body in blocks():
        if kind == "example-part":
            parts.setdefault(arg, []).append(body)
    assert parts, "no example-part blocks"
    for path, bodies in parts.items():
        assert no_blank_lines("".join(bodies)) == no_blank_lines((ROOT / path).read_text()), (
            f"{TUTORIAL.name}: the parts of {path} are not the file"
        )


def test_every_file_of_the_example_is_shown():
    shown = {arg for kind, arg, _ in blocks() if kind.startswith("example")}
    files = {
        str(p.relative_to(ROOT))
        for p in EXAMPLE.rglob("*")
        if p.suffix in (".py", ".toml")
        and not {"__pycache__", "build"} & set(p.parts)
        and not any(part.endswith(".egg-info") for part in p.parts)
    }
    assert files == shown


def test_backend_code_is_short():
    backend = EXAMPLE / "src" / "lmcache_backend_sqlite" / "backend.py"
    assert len(backend.read_text().splitlines()) <= 150


def test_example_uses_only_the_public_api():
    for path in EXAMPLE.rglob("*.py"):
        for mod in re.findall(r"^\s*(?:from|import) (lmcache_core[\w.]*)", path.read_text(), re.M):
            assert mod in {
                "lmcache_core",
                "lmcache_core.backend",
                "lmcache_core.blob",
                "lmcache_core.keys",
                "lmcache_core.config.options",
                "lmcache_core.plugins",
                "lmcache_core.testing",
                "lmcache_core.testing.blob",
            }, f"{path}: imports {mod}"


def local_registry(folder: Path, package: str, monkeypatch: pytest.MonkeyPatch) -> BackendRegistry:
    """The registry with ``package``'s hook registered (its ``src`` put on sys.path)."""
    monkeypatch.syspath_prepend(str(folder / "src"))
    plugin = importlib.import_module(f"{package}.plugin")
    reg = BackendRegistry()
    load_plugins(reg, entry_points=[], environ={})
    reg.current_provider = folder.name
    plugin.lmcache_register_backends(registry=reg)
    return reg


def test_the_tutorial_configuration_validates(monkeypatch):
    reg = local_registry(EXAMPLE, "lmcache_backend_sqlite", monkeypatch)
    (doc,) = [body for kind, arg, body in blocks() if kind == "check" and arg == "config"]
    cfg = load_config(yaml.safe_load(doc), registry=reg)
    assert [(t.name, t.backend) for t in cfg.tiers] == [("hot", "cpu"), ("db", "sqlite")]


@pytest.mark.parametrize("folder,package", LOCAL_PACKAGES, ids=lambda x: getattr(x, "name", x))
def test_local_package_option_tables_are_current(folder, package, monkeypatch):
    reg = local_registry(folder, package, monkeypatch)
    tables = options_blocks((folder / "README.md").read_text())
    assert tables, f"{folder}/README.md embeds no options table"
    for name, body in tables.items():
        assert body == options_markdown(reg.get(name)), (
            f"{folder}/README.md: the options table of {name!r} is stale"
        )
    sys.modules.pop(f"{package}.plugin", None)


def test_getting_started_code_runs(tmp_path):
    import subprocess

    text = (ROOT / "docs" / "getting-started.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    script = tmp_path / "getting_started.py"
    script.write_text(code.replace('"/tmp/kv"', repr(str(tmp_path / "kv"))))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "4 chunks hit"
