"""``lmcache-core plugins`` / ``backends``: the real console script, run as a subprocess.

Third-party plugins are real ``*.dist-info`` folders on ``PYTHONPATH`` (found by
importlib.metadata exactly like installed distributions) pointing at fixture modules.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pty
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "plugin_fixtures"))

from fakedist import FIXTURES, write_dist_info

from lmcache_core.backends.cpu import CPUOptions
from lmcache_core.cli import main as cli
from lmcache_core.config.options import describe_options
from lmcache_core.tables import format_table

SCRIPT = Path(sys.executable).with_name("lmcache-core")
if not SCRIPT.exists():  # pragma: no cover - e.g. a non-venv interpreter
    SCRIPT = Path(shutil.which("lmcache-core") or "lmcache-core")


def child_env(path: Path | None = None, env: dict[str, str] | None = None) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_CORE_")}
    parts = [str(path)] if path else []
    environ["PYTHONPATH"] = os.pathsep.join([*parts, str(FIXTURES)])
    environ.update(env or {})
    return environ


def run(*args: str, path: Path | None = None, env: dict[str, str] | None = None):
    return subprocess.run(
        [str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=child_env(path, env),
        timeout=120,
    )


def run_on_terminal(*args: str) -> tuple[int, str]:
    """Run with stdout on a pseudo-terminal; returns the exit status and the output."""
    primary, secondary = pty.openpty()
    try:
        proc = subprocess.Popen([str(SCRIPT), *args], stdout=secondary, env=child_env())
    finally:
        os.close(secondary)
    chunks = []
    try:
        while True:
            try:
                data = os.read(primary, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(primary)
    return proc.wait(timeout=120), b"".join(chunks).decode()


@pytest.fixture
def plugin_path(tmp_path: Path) -> Path:
    """A sys.path entry holding one good, one broken and one misspelled plugin."""
    write_dist_info(tmp_path, "lmcfix-good", "lmcfix_good", version="1.2.3")
    write_dist_info(tmp_path, "lmcfix-broken", "lmcfix_broken_import", version="0.0.9")
    write_dist_info(tmp_path, "lmcfix-misspelled", "lmcfix_misspelled", version="0.1")
    return tmp_path


def by_name(items: list[dict], name: str) -> dict:
    (found,) = [i for i in items if i["name"] == name]
    return found


def test_backends_json_lists_cpu_with_its_options():
    res = run("backends", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    cpu = by_name(doc["backends"], "cpu")
    assert cpu["status"] == "ok" and cpu["error"] is None
    assert cpu["provider"] == "lmcache-core"
    assert cpu["target"] == "lmcache_core.backends.cpu:CPUBackend"
    assert set(cpu["schemes"]) == {"cpu", "memory"}
    assert cpu["capabilities"]["bounded"] is True
    assert cpu["options"] == json.loads(json.dumps(describe_options(CPUOptions)))
    max_bytes = by_name(cpu["options"], "max_bytes")
    assert max_bytes["type"] == "bytes"
    assert max_bytes["default"] == dataclasses.fields(CPUOptions)[0].default
    assert max_bytes["doc"]
    assert {o["name"] for o in cpu["options"]} == {f.name for f in dataclasses.fields(CPUOptions)}


def test_output_is_json_when_piped_and_a_table_on_a_terminal():
    piped = run("backends")
    assert json.loads(piped.stdout)["backends"]
    rc, out = run_on_terminal("backends")
    assert rc == 0
    assert "BACKEND" in out and "max_bytes" in out and "1.0 GiB" in out
    assert not out.lstrip().startswith("{")


def test_plugins_reports_broken_plugins_without_crashing(plugin_path):
    res = run("plugins", "--json", path=plugin_path)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    doc = json.loads(res.stdout)
    plugins = doc["plugins"]
    core = by_name(plugins, "lmcache-core")
    assert core["status"] == "ok" and core["builtin"] and core["backends"] == ["cpu"]
    good = by_name(plugins, "lmcfix-good")
    assert (good["status"], good["version"], good["error"]) == ("ok", "1.2.3", None)
    assert good["hooks"] == ["lmcache_register_backends"]
    assert good["backends"] == ["fixture"] and good["schemes"] == ["fixture"]
    broken = by_name(plugins, "lmcfix-broken")
    assert broken["status"] == "failed" and broken["version"] == "0.0.9"
    assert "exploded at import" in broken["error"]
    misspelled = by_name(plugins, "lmcfix-misspelled")
    assert misspelled["status"] == "failed"
    assert "unknown hook 'lmcache_register_backend'" in misspelled["error"]
    assert doc["hookspec_version"] == "1.0"
    # the loader's warnings go to stderr, naming plugin, version and error
    assert "lmcfix-broken 0.0.9" in res.stderr and "exploded at import" in res.stderr


def test_plugins_table_and_strict_exit_status(plugin_path):
    res = run("plugins", "--table", path=plugin_path)
    assert res.returncode == 0, res.stderr
    assert "PLUGIN" in res.stdout and "lmcfix-broken" in res.stdout
    assert "lmcfix-broken: failed: import of 'lmcfix_broken_import' failed" in res.stdout
    strict = run("plugins", "--json", path=plugin_path, env={"LMCACHE_CORE_STRICT_PLUGINS": "1"})
    assert strict.returncode == 1
    assert "Traceback" not in strict.stderr
    assert by_name(json.loads(strict.stdout)["plugins"], "lmcfix-broken")["status"] == "failed"
    disabled = run(
        "plugins",
        "--json",
        "--strict",
        path=plugin_path,
        env={"LMCACHE_CORE_DISABLE_PLUGINS": "lmcfix-broken,lmcfix-misspelled"},
    )
    assert disabled.returncode == 0, disabled.stdout
    statuses = {
        p["name"]: p["status"]
        for p in json.loads(disabled.stdout)["plugins"]
        if p["name"].startswith(("lmcfix-", "lmcache-core"))
    }
    assert statuses == {
        "lmcache-core": "ok",
        "lmcfix-good": "ok",
        "lmcfix-broken": "disabled",
        "lmcfix-misspelled": "disabled",
    }


def test_backends_of_a_plugin_and_unknown_names(plugin_path):
    res = run("backends", "fixture", "--json", path=plugin_path)
    assert res.returncode == 0, res.stderr
    (fx,) = json.loads(res.stdout)["backends"]
    assert (fx["provider"], fx["version"], fx["schemes"]) == ("lmcfix-good", "1.2.3", ["fixture"])
    region = by_name(fx["options"], "region")
    assert region["required"] is True and region["type"] == "str"
    assert fx["capabilities"]["persistent"] is True

    unknown = run("backends", "s3", env={"LMCACHE_CORE_DISABLE_PLUGINS": "*"})
    assert unknown.returncode == 1
    assert "unknown backend 's3'" in unknown.stderr
    assert (
        "lmcache-backend-s3 is installed but its plugin is not loaded: disabled by "
        "LMCACHE_CORE_DISABLE_PLUGINS"
    ) in unknown.stderr
    assert "registered: cpu" in unknown.stderr


def test_backends_markdown():
    res = run("backends", "cpu", "--markdown")
    assert res.returncode == 0, res.stderr
    assert "### `cpu` options" in res.stdout
    assert "| `max_bytes` | bytes | `1.0 GiB` |" in res.stdout


def test_no_command_prints_usage_and_version_works():
    res = run()
    assert res.returncode == 2 and "plugins" in res.stderr and "backends" in res.stderr
    ver = run("--version")
    assert ver.returncode == 0 and ver.stdout.startswith("lmcache-core ")
    from lmcache_core import token_db

    on = token_db._native_int32_le is not None
    assert ("compiled speedups: on" in ver.stdout) is on, ver.stdout


def test_dispatcher_skips_missing_modules_and_reports_broken_ones(capsys):
    parser = cli.build_parser(
        ["lmcache_core.cli.plugins", "lmcfix_no_such_cli_module", "lmcfix_broken_import"]
    )
    err = capsys.readouterr().err
    assert "lmcfix_no_such_cli_module" not in err  # absent modules are skipped silently
    assert "lmcfix_broken_import unavailable" in err and "exploded at import" in err
    args = parser.parse_args(["backends", "--json"])
    assert args.func.__name__ == "run_backends" and args.output == "json"


def test_command_modules_list():
    assert cli.COMMAND_MODULES[0] == "lmcache_core.cli.plugins"
    assert {"lmcache_core.cli.config", "lmcache_core.cli.inspect", "lmcache_core.cli.maint"} <= set(
        cli.COMMAND_MODULES
    )


def test_format_table():
    text = format_table([["a", None], ["bbb", 1]], ["X", "Y"])
    assert text.splitlines() == ["X    Y", "---  -", "a    -", "bbb  1"]
