"""Real discovery of an installed first-party distribution: ``lmcache-backend-disk``.

Nothing is faked: the distribution is pip-installed (editable) in the environment, as
``make venv`` does for every distribution under ``backends/``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

from lmcache_core.errors import ConfigError
from lmcache_core.plugins import (
    ENTRY_POINT_GROUP,
    BackendRegistry,
    discover_entry_points,
    get_registry,
    load_plugins,
    validate_backend_options,
)

ROOT = Path(__file__).resolve().parents[1]
DIST = "lmcache-backend-disk"


@pytest.fixture(scope="module")
def disk_dist():
    if not (ROOT / "backends" / DIST).is_dir():
        pytest.skip(f"{DIST} is not part of this checkout")
    try:
        return distribution(DIST)
    except PackageNotFoundError:
        pytest.fail(
            f"{DIST} is in the repository but not installed: pip install -e backends/{DIST}"
        )


def test_entry_point_follows_the_conventions(disk_dist):
    (ep,) = [ep for ep in disk_dist.entry_points if ep.group == ENTRY_POINT_GROUP]
    assert ep.name == DIST  # entry-point name = distribution name
    assert ":" not in ep.value  # the plugin is a module holding only hook implementations
    assert DIST in [e.name for e in discover_entry_points()]


def test_installed_backend_is_registered(disk_dist, monkeypatch):
    for var in ("LMCACHE_CORE_DISABLE_PLUGINS", "LMCACHE_CORE_LOAD_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LMCACHE_CORE_STRICT_PLUGINS", "1")
    reg = get_registry(reload=True)
    (info,) = [p for p in reg.plugins if p.name == DIST]
    assert (info.status, info.version, info.distribution) == ("ok", disk_dist.version, DIST)
    assert info.hooks == ["lmcache_register_backends"]
    spec = reg.get("disk")
    assert spec.provider == DIST
    assert reg.for_scheme("file") is spec
    cls = spec.load()
    assert cls.capabilities.persistent
    names = {o["name"] for o in spec.describe_options()}
    assert {"path", "max_bytes"} <= names


def test_installed_backend_options_validate(disk_dist, tmp_path):
    spec = get_registry().get("disk")
    opts = validate_backend_options(
        spec, {"path": str(tmp_path), "max_bytes": "1GiB"}, "tiers[1].options"
    )
    assert opts.path == str(tmp_path) and opts.max_bytes == 2**30
    with pytest.raises(ConfigError) as ei:
        validate_backend_options(
            spec, {"path": str(tmp_path), "max_bytes": "huge"}, "tiers[1].options"
        )
    assert ei.value.path == "tiers[1].options.max_bytes"


def test_installed_plugin_can_be_disabled(disk_dist):
    reg = BackendRegistry()
    load_plugins(reg, environ={"LMCACHE_CORE_DISABLE_PLUGINS": DIST})
    assert "disk" not in reg
    with pytest.raises(
        LookupError,
        match=rf"{DIST} is installed but its plugin is not loaded: disabled by LMCACHE_CORE_DISABLE",
    ):
        reg.get("disk")
