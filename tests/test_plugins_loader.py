"""Plugin loading with fake entry points (real importlib.metadata objects, nothing installed)."""

from __future__ import annotations

import logging
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "plugin_fixtures"))

from fakedist import fake_entry_point

from lmcache_core.errors import UnknownBackendError
from lmcache_core.plugins import (
    BackendRegistry,
    PluginLoadError,
    PluginSettings,
    get_registry,
    load_plugins,
)
from lmcache_core.plugins.compat import core_version

LENIENT = PluginSettings(strict=False)
STRICT = PluginSettings(strict=True)


def load(*eps, settings=LENIENT):
    reg = BackendRegistry()
    load_plugins(reg, entry_points=list(eps), settings=settings)
    return reg


def info(reg, name):
    (found,) = [p for p in reg.plugins if p.name == name]
    return found


def test_builtin_cpu_loads_through_the_hook():
    reg = load()
    assert reg.names() == ["cpu"]
    core = info(reg, "lmcache-core")
    assert core.builtin and core.status == "ok"
    assert core.hooks == ["lmcache_register_backends", "lmcache_register_policies"]
    assert core.version == core_version()
    assert reg.get("cpu").provider == "lmcache-core"
    assert reg.plugin_manager is not None
    assert reg.plugin_manager.get_plugin("lmcache-core") is not None


def test_good_plugin_registers_lazily_with_its_name_and_version():
    sys.modules.pop("lmcfix_backend", None)
    reg = load(fake_entry_point("lmcfix-good", "lmcfix_good", version="2.3.4"))
    good = info(reg, "lmcfix-good")
    assert (good.status, good.version, good.distribution) == ("ok", "2.3.4", "lmcfix-good")
    assert good.hooks == ["lmcache_register_backends"]
    spec = reg.get("fixture")
    assert spec.provider == "lmcfix-good"
    assert reg.for_scheme("fixture") is spec
    assert "lmcfix_backend" not in sys.modules  # registered as "module:Class": not imported
    assert spec.load().__name__ == "FixtureBackend"
    assert "lmcfix_backend" in sys.modules


def test_broken_plugin_is_skipped_with_a_warning(caplog):
    eps = [
        fake_entry_point("lmcfix-broken", "lmcfix_broken_import", version="0.0.7"),
        fake_entry_point("lmcfix-good", "lmcfix_good"),
    ]
    with caplog.at_level(logging.WARNING, logger="lmcache_core.plugins"):
        reg = load(*eps)
    broken = info(reg, "lmcfix-broken")
    assert broken.status == "failed"
    assert "RuntimeError" in broken.error and "exploded at import" in broken.error
    assert broken.version == "0.0.7"
    assert reg.names() == ["cpu", "fixture"]  # the others still load
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "lmcfix-broken 0.0.7" in warning and "exploded at import" in warning


def test_strict_mode_raises_on_a_broken_plugin():
    ep = fake_entry_point("lmcfix-broken", "lmcfix_broken_import", version="0.0.7")
    with pytest.raises(PluginLoadError, match=r"lmcfix-broken 0\.0\.7.*exploded at import") as ei:
        load(ep, settings=STRICT)
    assert ei.value.info.status == "failed"
    assert isinstance(ei.value.__cause__, RuntimeError)


def test_strict_mode_comes_from_the_environment():
    ep = fake_entry_point("lmcfix-broken", "lmcfix_broken_import")
    reg = BackendRegistry()
    with pytest.raises(PluginLoadError):
        load_plugins(reg, entry_points=[ep], environ={"LMCACHE_CORE_STRICT_PLUGINS": "1"})
    reg = BackendRegistry()
    load_plugins(reg, entry_points=[ep], environ={"LMCACHE_CORE_STRICT_PLUGINS": "0"})
    assert info(reg, "lmcfix-broken").status == "failed"


def test_duplicate_backend_name_names_both_providers():
    reg = load(fake_entry_point("lmcfix-dup", "lmcfix_dup"))
    dup = info(reg, "lmcfix-dup")
    assert dup.status == "failed"
    assert "DuplicateBackendError" in dup.error
    assert "'lmcache-core'" in dup.error and "'lmcfix-dup'" in dup.error
    assert reg.get("cpu").provider == "lmcache-core"  # the first registration stands
    with pytest.raises(PluginLoadError, match="registered twice"):
        load(fake_entry_point("lmcfix-dup", "lmcfix_dup"), settings=STRICT)


def test_override_replaces_on_purpose():
    reg = load(fake_entry_point("lmcfix-override", "lmcfix_override"), settings=STRICT)
    assert reg.get("cpu").provider == "lmcfix-override"
    assert reg.get("cpu").load().__name__ == "FixtureBackend"


def test_hook_that_raises_is_rolled_back():
    reg = load(
        fake_entry_point("lmcfix-good", "lmcfix_good"),
        fake_entry_point("lmcfix-half", "lmcfix_hook_raises"),
    )
    half = info(reg, "lmcfix-half")
    assert half.status == "failed" and "failed half way" in half.error
    assert "half-done" not in reg.names()
    with pytest.raises(UnknownBackendError):
        reg.for_scheme("half")
    assert reg.names() == ["cpu", "fixture"]
    assert reg.plugin_manager.get_plugin("lmcfix-half") is None


def test_disabled_plugin_is_not_imported():
    sys.modules.pop("lmcfix_import_tracker_was_imported", None)
    sys.modules.pop("lmcfix_import_tracker", None)
    eps = [
        fake_entry_point("lmcfix-tracker", "lmcfix_import_tracker"),
        fake_entry_point("lmcfix-good", "lmcfix_good"),
    ]
    reg = BackendRegistry()
    # names are normalized (PEP 503), so the spelling of the distribution name does not matter
    load_plugins(
        reg, entry_points=eps, environ={"LMCACHE_CORE_DISABLE_PLUGINS": " LMCfix_Tracker ,x"}
    )
    tracker = info(reg, "lmcfix-tracker")
    assert tracker.status == "disabled" and "LMCACHE_CORE_DISABLE_PLUGINS" in tracker.error
    assert "lmcfix_import_tracker_was_imported" not in sys.modules
    assert reg.names() == ["cpu", "fixture"]


def test_disable_star_keeps_only_the_builtin():
    eps = [fake_entry_point("lmcfix-good", "lmcfix_good")]
    reg = BackendRegistry()
    load_plugins(
        reg,
        entry_points=eps,
        environ={
            "LMCACHE_CORE_DISABLE_PLUGINS": "*,lmcache-core",
            "LMCACHE_CORE_STRICT_PLUGINS": "1",
        },
    )
    assert reg.names() == ["cpu"]  # the built-in plugin cannot be disabled
    assert info(reg, "lmcfix-good").status == "disabled"


def test_allow_list():
    eps = [
        fake_entry_point("lmcfix-good", "lmcfix_good"),
        fake_entry_point("lmcfix-other", "lmcfix_other"),
        fake_entry_point("lmcfix-broken", "lmcfix_broken_import"),
    ]
    reg = BackendRegistry()
    load_plugins(
        reg,
        entry_points=eps,
        environ={"LMCACHE_CORE_LOAD_PLUGINS": "lmcfix-other", "LMCACHE_CORE_STRICT_PLUGINS": "1"},
    )
    assert reg.names() == ["cpu", "other"]  # built-in always; broken one never imported
    assert info(reg, "lmcfix-good").status == "disabled"
    assert "LMCACHE_CORE_LOAD_PLUGINS=lmcfix-other" in info(reg, "lmcfix-good").error
    assert info(reg, "lmcfix-broken").status == "disabled"
    # explicit settings take priority over the environment
    settings = PluginSettings.build(
        allowed="lmcfix-good", environ={"LMCACHE_CORE_LOAD_PLUGINS": "x"}
    )
    assert load(*eps[:2], settings=settings).names() == ["cpu", "fixture"]


def test_unknown_hook_name_fails_the_plugin():
    ep = fake_entry_point("lmcfix-misspelled", "lmcfix_misspelled")
    reg = load(ep, fake_entry_point("lmcfix-good", "lmcfix_good"))
    bad = info(reg, "lmcfix-misspelled")
    assert bad.status == "failed"
    assert "unknown hook 'lmcache_register_backend'" in bad.error
    assert bad.hooks == ["lmcache_register_backend"]
    assert reg.names() == ["cpu", "fixture"]
    assert reg.plugin_manager.get_plugin("lmcfix-misspelled") is None
    reg.plugin_manager.check_pending()  # the manager is clean again
    with pytest.raises(PluginLoadError, match="unknown hook"):
        load(ep, settings=STRICT)


def test_hook_with_an_unknown_argument_fails_the_plugin():
    reg = load(fake_entry_point("lmcfix-badsig", "lmcfix_bad_signature"))
    bad = info(reg, "lmcfix-badsig")
    assert bad.status == "failed" and "config" in bad.error
    assert reg.names() == ["cpu"]


def test_incompatible_core_requirement_is_skipped_before_import(caplog):
    sys.modules.pop("lmcfix_import_tracker_was_imported", None)
    sys.modules.pop("lmcfix_import_tracker", None)
    ep = fake_entry_point(
        "lmcfix-tracker",
        "lmcfix_import_tracker",
        version="3.1",
        requires=("lmcache-core>=99,<100",),
    )
    with caplog.at_level(logging.WARNING, logger="lmcache_core.plugins"):
        reg = load(ep)
    bad = info(reg, "lmcfix-tracker")
    assert bad.status == "incompatible"
    running = core_version()
    assert "requires lmcache-core" in bad.error and ">=99" in bad.error and running in bad.error
    assert "lmcfix-tracker 3.1" in bad.error
    assert "lmcfix_import_tracker_was_imported" not in sys.modules
    assert "tracked" not in reg.names()
    assert any(
        running in r.getMessage() and "incompatible" in r.getMessage() for r in caplog.records
    )
    with pytest.raises(PluginLoadError, match="incompatible"):
        load(ep, settings=STRICT)


def test_compatible_and_extra_only_requirements_load():
    ep = fake_entry_point(
        "lmcfix-good",
        "lmcfix_good",
        requires=("lmcache-core>=0.1", 'lmcache-core>=99; extra == "future"', "numpy"),
    )
    reg = load(ep, settings=STRICT)
    assert info(reg, "lmcfix-good").status == "ok"


def test_incompatible_hookspec_version():
    reg = load(fake_entry_point("lmcfix-future", "lmcfix_future_hooks"))
    bad = info(reg, "lmcfix-future")
    assert bad.status == "incompatible"
    assert "hook interface 2.0" in bad.error and "hook interface 1.0" in bad.error
    assert "future" not in reg.names()


def test_two_entry_points_with_the_same_name():
    reg = load(
        fake_entry_point("lmcfix-good", "lmcfix_good"),
        fake_entry_point("lmcfix-good", "lmcfix_other"),
    )
    statuses = [p.status for p in reg.plugins if p.name == "lmcfix-good"]
    assert statuses == ["ok", "failed"]
    assert "other" not in reg.names()


def test_unknown_name_mentions_a_plugin_that_failed():
    ep = fake_entry_point("lmcache-backend-disk", "lmcfix_broken_import", version="0.1.0")
    reg = load(ep)
    with pytest.raises(UnknownBackendError) as ei:
        reg.get("disk")
    msg = str(ei.value)
    assert "lmcache-backend-disk is installed but its plugin failed to load (failed)" in msg
    assert "exploded at import" in msg


def test_get_registry_is_cached_and_reloadable():
    first = get_registry()
    assert get_registry() is first
    assert "cpu" in first.names()
    again = get_registry(reload=True)
    assert again is not first and "cpu" in again.names()


def test_plugin_calling_sys_exit_does_not_end_the_process():
    reg = load(fake_entry_point("lmcfix-exits", "lmcfix_exits"))
    bad = info(reg, "lmcfix-exits")
    assert bad.status == "failed" and "SystemExit: 3" in bad.error
    assert reg.names() == ["cpu"]


def test_entry_point_without_distribution_metadata():
    ep = EntryPoint(name="lmcfix-bare", value="lmcfix_good", group="lmcache_core")
    reg = load(ep, settings=STRICT)
    bare = info(reg, "lmcfix-bare")
    assert (bare.status, bare.version, bare.distribution) == ("ok", None, None)
    assert bare.describe() == "lmcfix-bare"
    assert reg.get("fixture").provider == "lmcfix-bare"
