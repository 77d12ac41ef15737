"""Diagnostics of plugin packaging mistakes: one test per mistake, asserting what users see.

Each mistake is made for real: a ``*.dist-info`` folder on ``PYTHONPATH`` (found by
importlib.metadata exactly like an installed distribution) pointing at a fixture module,
and the real ``lmcache-core`` console script run as a subprocess.
"""

from __future__ import annotations

import json
import logging
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "plugin_fixtures"))

from fakedist import fake_entry_point, write_dist_info
from test_cli_plugins import by_name, run

from lmcache_core.errors import UnknownBackendError
from lmcache_core.plugins import KNOWN_BACKENDS, BackendRegistry, load_plugins
from lmcache_core.plugins.registry import KNOWN_SCHEMES
from lmcache_core.plugins.settings import PluginSettings

ROOT = Path(__file__).resolve().parents[1]


def write_wrong_group_dist(root: Path, name: str, group: str) -> None:
    """An installed distribution whose entry point sits in ``group`` instead of lmcache_core."""
    d = root / f"{name.replace('-', '_')}-0.3.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.3\n")
    (d / "entry_points.txt").write_text(f"[{group}]\n{name} = lmcfix_good\n")


def test_distribution_without_our_entry_point_is_flagged(tmp_path):
    write_wrong_group_dist(tmp_path, "lmcache-backend-wronggroup", "lmcache")
    res = run("plugins", "--table", path=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (
        "lmcache-backend-wronggroup: misconfigured: installed, but declares no entry point in "
        "group 'lmcache_core', so it is never loaded (it declares [lmcache] "
        "lmcache-backend-wronggroup = lmcfix_good: a wrong group?); its pyproject.toml needs "
        "[project.entry-points.lmcache_core] lmcache-backend-wronggroup = "
        '"lmcache_backend_wronggroup.plugin"'
    ) in res.stdout
    strict = run("plugins", "--strict", "--json", path=tmp_path)
    assert strict.returncode == 1
    row = by_name(json.loads(strict.stdout)["plugins"], "lmcache-backend-wronggroup")
    assert (row["status"], row["version"]) == ("misconfigured", "0.3")
    # a distribution that is not named like a plugin is none of our business
    other = tmp_path / "other"
    write_wrong_group_dist(other, "lmcache-extras", "lmcache")
    res = run("plugins", "--strict", "--json", path=other)
    assert res.returncode == 0, res.stdout
    assert "lmcache-extras" not in res.stdout


def test_plugin_module_without_hook_implementation_is_flagged(tmp_path):
    write_dist_info(tmp_path, "lmcfix-nohook", "lmcfix_no_hookimpl")
    res = run("plugins", "--table", path=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (
        "lmcfix-nohook: misconfigured: 'lmcfix_no_hookimpl' implements no hook: "
        "lmcache_register_backends is not decorated with @hookimpl "
        "(from lmcache_core.plugins import hookimpl), so pluggy ignores it"
    ) in res.stdout
    assert run("plugins", "--strict", path=tmp_path).returncode == 1
    # and nothing it would have registered is there
    assert (
        "forgotten" not in json.loads(run("backends", "--json", path=tmp_path).stdout)["backends"]
    )


def test_config_check_says_the_plugin_of_an_unknown_backend_failed(tmp_path):
    write_dist_info(tmp_path, "lmcache-backend-sqlite", "lmcfix_broken_import", version="0.2")
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text("tiers:\n  - backend: cpu\n  - backend: sqlite\n")
    res = run("config", "check", str(cfg), "--table", path=tmp_path)
    assert res.returncode == 1
    assert "tiers[1].backend: unknown backend 'sqlite'; registered: cpu, " in res.stderr
    assert (
        "; installed plugin(s) that did not load (it may provide it): lmcache-backend-sqlite 0.2 "
        "failed to load (failed): import of 'lmcfix_broken_import' failed: "
    ) in res.stderr
    assert "exploded at import" in res.stderr


def test_replacing_a_builtin_is_shown_and_logged(tmp_path, caplog):
    write_dist_info(tmp_path, "lmcfix-override", "lmcfix_override", version="2.0")
    plugins = run("plugins", "--table", path=tmp_path)
    assert plugins.returncode == 0, plugins.stderr
    assert (
        "lmcfix-override: replaces backend 'cpu' of lmcache-core (override=True)" in plugins.stdout
    )
    backends = run("backends", "cpu", "--json", path=tmp_path)
    (cpu,) = json.loads(backends.stdout)["backends"]
    assert (cpu["provider"], cpu["replaces"]) == ("lmcfix-override", "lmcache-core")
    assert set(cpu["schemes"]) == {"cpu", "memory"}  # memory:// still reaches cpu
    table = run("backends", "cpu", "--table", path=tmp_path)
    assert "lmcfix-override (replaces lmcache-core)" in table.stdout
    # logged where the replacement happens
    with caplog.at_level(logging.WARNING, logger="lmcache_core.plugins"):
        reg = BackendRegistry()
        load_plugins(reg, entry_points=[fake_entry_point("lmcfix-override", "lmcfix_override")])
    assert (
        "backend 'cpu' registered by 'lmcache-core' is replaced by 'lmcfix-override''s "
        "lmcfix_backend:FixtureBackend (override=True)"
    ) in caplog.text


def test_install_hints_name_only_distributions_that_exist():
    for name, dist in KNOWN_BACKENDS.items():
        if dist == "lmcache-core":
            continue
        pyproject = ROOT / "backends" / dist / "pyproject.toml"
        assert pyproject.is_file(), f"{name}: {dist} is not in backends/"
        project = tomllib.loads(pyproject.read_text())["project"]
        assert project["name"] == dist
        plugin_src = "".join(p.read_text() for p in (ROOT / "backends" / dist).rglob("plugin.py"))
        assert f'name="{name}"' in plugin_src, f"{dist} does not register {name!r}"
    assert set(KNOWN_SCHEMES.values()) <= set(KNOWN_BACKENDS)
    res = run("backends", "--table", env={"LMCACHE_CORE_DISABLE_PLUGINS": "*"})
    assert res.returncode == 0, res.stderr
    assert (
        "  disk: pip install ./backends/lmcache-backend-disk (in an lmcache-core checkout)"
        in res.stdout
    )
    assert "redis" not in res.stdout
    unknown = run("backends", "redis", env={"LMCACHE_CORE_DISABLE_PLUGINS": "*"})
    assert unknown.returncode == 1 and "pip install" not in unknown.stderr


def test_backend_option_typo_gets_did_you_mean_and_the_exact_path(tmp_path):
    cfg = tmp_path / "tiers.yaml"
    cfg.write_text("tiers:\n  - backend: cpu\n    options: {max_byte: 1GiB}\n")
    res = run("config", "check", str(cfg), "--table")
    assert res.returncode == 1
    assert (
        "invalid configuration: tiers[0].options.max_byte: unknown option; "
        "did you mean 'max_bytes'? (known: "
    ) in res.stderr


def test_strict_plugins_fails_on_a_class_name_typo_in_a_target(tmp_path):
    write_dist_info(tmp_path, "lmcfix-typo", "lmcfix_typo_target", version="0.5")
    lax = run("plugins", "--table", path=tmp_path)
    assert lax.returncode == 0  # listing imports no backend class
    strict = run("plugins", "--strict", "--table", path=tmp_path)
    assert strict.returncode == 1
    assert (
        "lmcfix-typo: failed: backend 'typo': BackendLoadError: backend 'typo' (registered by "
        "'lmcfix-typo') cannot be loaded: module 'lmcfix_backend' has no attribute "
        "'FixtureBackedn'"
    ) in strict.stdout


def test_strict_plugins_fails_on_a_class_that_is_not_a_backend(tmp_path):
    write_dist_info(tmp_path, "lmcfix-hollow", "lmcfix_not_a_backend")
    strict = run("plugins", "--strict", "--json", path=tmp_path)
    assert strict.returncode == 1
    missing, no_capabilities, no_options = by_name(
        json.loads(strict.stdout)["plugins"], "lmcfix-hollow"
    )["problems"]
    assert no_capabilities == (
        "backend 'hollow': lmcfix_backend.NoOptionsBackend.capabilities must be a "
        "lmcache_core.interface.Capabilities (got NoneType)"
    )
    assert missing.startswith(
        "backend 'hollow': lmcfix_backend.NoOptionsBackend is not a storage backend: missing "
        "start, close, contains"
    )
    assert no_options.startswith(
        "backend 'hollow': lmcfix_backend.NoOptionsBackend declares no Options dataclass"
    )
    listing = json.loads(run("backends", "hollow", "--json", path=tmp_path).stdout)
    assert listing["backends"][0]["status"] == "failed"


def test_strict_loading_raises_on_a_misconfigured_plugin():
    from lmcache_core.plugins import PluginLoadError

    with pytest.raises(PluginLoadError, match="implements no hook"):
        load_plugins(
            BackendRegistry(),
            entry_points=[fake_entry_point("lmcfix-nohook", "lmcfix_no_hookimpl")],
            settings=PluginSettings(strict=True),
        )


def test_unknown_backend_lists_at_most_three_failed_plugins():
    eps = [
        fake_entry_point(f"lmcfix-broken-{i}", "lmcfix_broken_import", version="0.1")
        for i in range(5)
    ]
    reg = BackendRegistry()
    load_plugins(reg, entry_points=eps)
    with pytest.raises(UnknownBackendError) as ei:
        reg.get("redis")
    msg = str(ei.value)
    assert "(one of them may provide it)" in msg
    assert msg.count("failed to load (failed)") == 3
    assert msg.endswith("(and 2 more: lmcache-core plugins)")
