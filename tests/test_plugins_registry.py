"""The backend registry, ``backend_class`` resolution, option validation and compatibility."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "plugin_fixtures"))

from lmcache_core.backends.cpu import CPUBackend, CPUOptions
from lmcache_core.errors import ConfigError, DuplicateBackendError, PluginError, UnknownBackendError
from lmcache_core.plugins import (
    KNOWN_BACKENDS,
    BackendLoadError,
    BackendRegistry,
    describe_backend_options,
    load_backend_class,
    options_markdown,
    validate_backend_options,
)
from lmcache_core.plugins.compat import (
    _satisfies,
    _satisfies_fallback,
    canonical_name,
    core_requirement_problem,
)
from lmcache_core.plugins.settings import PluginSettings

FIXTURE = "lmcfix_backend:FixtureBackend"


def registry() -> BackendRegistry:
    reg = BackendRegistry()
    reg.add(CPUBackend, name="cpu", schemes=("cpu", "memory"), provider="lmcache-core")
    return reg


def test_add_get_names_and_schemes():
    reg = registry()
    reg.add(
        FIXTURE, name="fixture", schemes=["fx"], provider="lmcfix", install_hint="pip install x"
    )
    assert reg.names() == ["cpu", "fixture"]
    assert [s.name for s in reg.specs()] == ["cpu", "fixture"]
    assert reg.schemes() == {"cpu": "cpu", "fx": "fixture", "memory": "cpu"}
    spec = reg.get("fixture")
    assert (spec.provider, spec.schemes, spec.install_hint) == ("lmcfix", ("fx",), "pip install x")
    assert spec.target_text == FIXTURE
    assert reg.get("cpu").target_text == "lmcache_core.backends.cpu:CPUBackend"
    assert reg.for_scheme("memory").load() is CPUBackend
    assert "fixture" in reg and "nope" not in reg


def test_current_provider_is_recorded():
    reg = BackendRegistry()
    reg.current_provider = "some-dist"
    reg.add(FIXTURE, name="fixture")
    assert reg.get("fixture").provider == "some-dist"


def test_duplicate_name_raises_naming_both_providers():
    reg = registry()
    with pytest.raises(DuplicateBackendError) as ei:
        reg.add(FIXTURE, name="cpu", provider="lmcache-backend-evil")
    assert "'lmcache-core'" in str(ei.value) and "'lmcache-backend-evil'" in str(ei.value)
    assert reg.get("cpu").load() is CPUBackend


def test_duplicate_scheme_raises():
    reg = registry()
    with pytest.raises(DuplicateBackendError, match=r"scheme 'memory'.*'lmcache-core'.*'other'"):
        reg.add(FIXTURE, name="fixture", schemes=("memory",), provider="other")
    assert "fixture" not in reg


def test_override_replaces_name_and_schemes():
    reg = registry()
    reg.add(FIXTURE, name="cpu", schemes=("ram",), override=True, provider="mine")
    spec = reg.get("cpu")
    assert spec.provider == "mine" and spec.load().__name__ == "FixtureBackend"
    assert spec.replaces == "lmcache-core"
    # the replaced backend's schemes still reach the name (memory:// still works)
    assert reg.schemes() == {"cpu": "cpu", "memory": "cpu", "ram": "cpu"}
    assert reg.for_scheme("memory") is spec


@pytest.mark.parametrize("bad", ["", " cpu", "a:b"])
def test_invalid_names_are_refused(bad):
    with pytest.raises(PluginError, match="invalid backend name"):
        BackendRegistry().add(FIXTURE, name=bad)


def test_invalid_targets_are_refused():
    with pytest.raises(PluginError, match=r"pkg\.mod:Class"):
        BackendRegistry().add("lmcfix_backend.FixtureBackend", name="x")
    with pytest.raises(PluginError, match="class or 'pkg"):
        BackendRegistry().add(42, name="x")  # type: ignore[arg-type]


def test_unknown_name_lists_registered_and_the_install_command():
    reg = registry()
    for name, dist in KNOWN_BACKENDS.items():
        if name == "cpu":
            continue
        with pytest.raises(UnknownBackendError) as ei:
            reg.get(name)
        msg = str(ei.value)
        assert f"unknown backend {name!r}" in msg
        assert "registered: cpu" in msg
        assert f"; {dist} provides it: pip install ./backends/{dist} (in an lmcache-core" in msg
    with pytest.raises(UnknownBackendError, match="did you mean 'cpu'"):
        reg.get("cpuu")
    with pytest.raises(LookupError, match=r"registered: cpu$"):
        reg.get("zzz")


def test_unknown_scheme_names_the_install_command():
    reg = registry()
    with pytest.raises(
        UnknownBackendError, match=r"'s3'.*pip install ./backends/lmcache-backend-s3"
    ):
        reg.for_scheme("s3")
    with pytest.raises(UnknownBackendError, match=r"pip install ./backends/lmcache-backend-disk"):
        reg.for_scheme("file")
    with pytest.raises(
        UnknownBackendError, match=r"'gopher'; registered schemes: \['cpu', 'memory'\]$"
    ):
        reg.for_scheme("gopher")


def test_lazy_import_happens_on_first_load_only():
    sys.modules.pop("lmcfix_backend", None)
    reg = BackendRegistry()
    reg.add(FIXTURE, name="fixture")
    assert "lmcfix_backend" not in sys.modules
    cls = reg.get("fixture").load()
    assert "lmcfix_backend" in sys.modules
    assert reg.get("fixture").load() is cls


def test_load_backend_class():
    assert load_backend_class("lmcache_core.backends.cpu:CPUBackend") is CPUBackend
    assert load_backend_class(CPUBackend) is CPUBackend
    assert load_backend_class(" lmcfix_backend:FixtureBackend ").__name__ == "FixtureBackend"
    with pytest.raises(BackendLoadError, match=r"must look like 'package\.module:Class'"):
        load_backend_class("lmcfix_backend.FixtureBackend")
    with pytest.raises(BackendLoadError, match="cannot import module 'no_such_mod_xyz'"):
        load_backend_class("no_such_mod_xyz:Thing")
    with pytest.raises(ImportError, match="exploded at import"):
        load_backend_class("lmcfix_broken_import:Thing")
    with pytest.raises(BackendLoadError, match="has no attribute 'Nope'"):
        load_backend_class("lmcfix_backend:Nope")
    with pytest.raises(BackendLoadError, match="not a class"):
        load_backend_class("lmcfix_backend:FixtureOptions.__doc__")


def test_spec_load_error_names_backend_and_provider():
    reg = BackendRegistry()
    reg.add("lmcfix_backend:Gone", name="gone", provider="lmcache-backend-gone")
    with pytest.raises(BackendLoadError, match=r"backend 'gone' .*'lmcache-backend-gone'.*Gone"):
        reg.get("gone").load()


def test_validate_backend_options_returns_typed_options():
    reg = registry()
    opts = validate_backend_options(reg.get("cpu"), {"max_bytes": "64MiB", "pin_memory": "false"})
    assert isinstance(opts, CPUOptions)
    assert opts.max_bytes == 64 * 2**20 and opts.pin_memory == "false"
    assert validate_backend_options(CPUBackend, None) == CPUOptions()


def test_validate_backend_options_errors_carry_the_path():
    path = "tiers[0].options"
    with pytest.raises(ConfigError) as ei:
        validate_backend_options(CPUBackend, {"max_bytes": "lots"}, path)
    assert ei.value.path == "tiers[0].options.max_bytes"
    with pytest.raises(ConfigError) as ei:
        validate_backend_options(CPUBackend, {"pin_memory": "maybe"}, path)
    assert ei.value.path == "tiers[0].options.pin_memory" and "auto" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        validate_backend_options(CPUBackend, {"max_byte": 1}, path)
    assert ei.value.path == "tiers[0].options.max_byte"
    assert str(ei.value).startswith(
        "tiers[0].options.max_byte: unknown option; did you mean 'max_bytes'? (known: "
    )
    with pytest.raises(ConfigError) as ei:
        validate_backend_options(load_backend_class(FIXTURE), {}, "tiers[2].options")
    assert ei.value.path == "tiers[2].options.region"


def test_backend_without_options_is_an_error():
    with pytest.raises(PluginError, match="declares no Options"):
        validate_backend_options(load_backend_class("lmcfix_backend:NoOptionsBackend"), {})


def test_describe_options_and_markdown():
    described = {o["name"]: o for o in describe_backend_options(load_backend_class(FIXTURE))}
    assert described["region"]["required"] and described["region"]["default_text"] == "(required)"
    assert described["max_bytes"] == {
        "name": "max_bytes",
        "type": "bytes",
        "default": 2**20,
        "default_text": "1.0 MiB",
        "required": False,
        "doc": "Capacity in bytes.",
        "choices": None,
    }
    md = options_markdown(CPUBackend).splitlines()
    assert md[0] == "| Option | Type | Default | Description |"
    assert len(md) == 2 + len(describe_backend_options(CPUBackend))
    assert any(
        line.startswith("| `pin_memory` | str (auto, true, false) | `auto` |") for line in md
    )


# --------------------------------------------------------------------------- compatibility
def test_canonical_name():
    assert canonical_name("LMCache_Backend.Disk") == "lmcache-backend-disk"
    assert canonical_name("a--b__c") == "a-b-c"


@pytest.mark.parametrize(
    ("running", "spec", "ok"),
    [
        ("0.1.0", ">=0.1", True),
        ("0.1.0", ">=0.2", False),
        ("0.1.0", "<0.1", False),
        ("0.1.0", ">=0.1,<1", True),
        ("1.0.0", ">=0.1,<1", False),
        ("0.1.5", "~=0.1.0", True),
        ("0.2.0", "~=0.1.0", False),
        ("0.1.0", "==0.1.*", True),
        ("0.2.0", "==0.1.*", False),
        ("0.1.0", "!=0.1.0", False),
        ("0.1.0", "==0.1", True),
        ("0.1.0", ">0.1", False),
        ("0.1.0", "<=0.1.0", True),
    ],
)
def test_specifier_check_and_fallback_agree(running, spec, ok):
    assert _satisfies(running, spec) is ok
    assert _satisfies_fallback(running, spec) is ok


def test_core_requirement_problem():
    assert core_requirement_problem(None, "0.1.0") is None
    assert core_requirement_problem(["numpy>=99", "lmcache-core"], "0.1.0") is None
    assert core_requirement_problem(['lmcache-core>=9; extra == "x"'], "0.1.0") is None
    assert core_requirement_problem(["not a requirement ((("], "0.1.0") is None
    problem = core_requirement_problem(["LMCache_Core >= 0.5"], "0.1.0")
    assert problem == "requires lmcache-core>=0.5 but the running lmcache-core is 0.1.0"


def test_settings_from_env():
    s = PluginSettings.from_env({})
    assert (s.strict, s.disabled, s.allowed) == (False, frozenset(), None)
    s = PluginSettings.from_env(
        {
            "LMCACHE_CORE_STRICT_PLUGINS": "yes",
            "LMCACHE_CORE_DISABLE_PLUGINS": "A_b, ,c",
            "LMCACHE_CORE_LOAD_PLUGINS": " ",
        }
    )
    assert (s.strict, s.disabled, s.allowed) == (True, frozenset({"a-b", "c"}), None)
    assert s.skip_reason("a.b") is not None and s.skip_reason("x", None) is None
    s = PluginSettings.from_env({"LMCACHE_CORE_LOAD_PLUGINS": "keep"})
    assert s.skip_reason("keep") is None
    assert s.skip_reason("entry-name", "Keep") is None  # matched through the distribution name
    assert "allow-list" in (s.skip_reason("other") or "")
