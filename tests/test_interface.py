"""The backend interface declared once (lmcache_core.interface): the protocols, the
class checks and the messages users see from registration, configuration, ``backends``
and ``plugins --strict``."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "plugin_fixtures"))

import lmcfix_iface_backends as bad
from fakedist import write_dist_info
from lmcfix_backend import FixtureBackend
from test_cli_plugins import by_name, run

from lmcache_core import interface
from lmcache_core.backend import BaseBackend
from lmcache_core.backends.cpu import CPUBackend
from lmcache_core.config import load_config
from lmcache_core.errors import ConfigError, PluginError
from lmcache_core.hierarchy import TieredHierarchy
from lmcache_core.interface import (
    INTERFACE_VERSION,
    OPTIONAL_PROTOCOLS,
    REQUIRED_METHODS,
    EvictionEvents,
    PrefixLookups,
    StorageBackend,
    ThreadSafeLoads,
    check_backend_class,
    implements,
    interface_version_problem,
)
from lmcache_core.plugins import BackendRegistry
from lmcache_core.sync import SyncBackend

ROOT = Path(__file__).resolve().parents[1]


def test_required_methods_are_those_of_the_protocol():
    assert REQUIRED_METHODS == (
        "start", "close", "contains", "get", "get_into", "put", "remove",
        "batched_contains", "batched_get", "batched_get_into", "batched_put", "stats",
    )  # fmt: skip
    assert interface.missing_members(BaseBackend, StorageBackend) == []


def test_first_party_classes_pass_and_name_their_capabilities():
    from lmcache_backend_disk.backend import DiskBackend
    from lmcache_backend_s3.backend import S3Backend

    cpu = check_backend_class(CPUBackend)
    assert (cpu.problems, cpu.warnings, cpu.interface_version) == ([], [], INTERFACE_VERSION)
    assert cpu.optional == [
        "ThreadSafeLoads", "ThreadSafeContains", "ThreadSafePuts", "ThreadSafeBorrows",
        "ReservedPuts", "EvictionEvents", "Pinning", "BatchedPinning", "VictimSelection",
        "EntryCharges",
    ]  # fmt: skip
    disk = check_backend_class(DiskBackend)
    assert (disk.problems, disk.warnings) == ([], [])
    assert {
        "Pinning",
        "BatchedPinning",
        "MaintainableBackend",
        "EntryChecks",
        "Reconcilable",
    } <= set(disk.optional)
    s3 = check_backend_class(S3Backend)
    assert (s3.problems, s3.warnings) == ([], [])
    assert {"PrefixContains", "MaintainableBackend", "EntryChecks"} <= set(s3.optional)
    assert interface.pins_do_io(DiskBackend) and not interface.pins_do_io(CPUBackend)
    hier = check_backend_class(TieredHierarchy)
    assert hier.problems == []
    assert {"PrefixLookups", "ThreadSafeLookups", "ThreadSafeLoads", "ThreadSafeBorrows"} <= set(
        hier.optional
    )


def test_implements_checks_instances_against_the_protocols():
    b = CPUBackend({"max_bytes": "1MiB"})
    assert implements(b, ThreadSafeLoads) and implements(b, EvictionEvents)
    assert not implements(b, PrefixLookups)
    assert not implements(object(), StorageBackend)
    for proto in OPTIONAL_PROTOCOLS:
        assert interface.missing_members(object(), proto), proto  # each declares methods


def test_implements_sees_methods_set_on_an_instance():
    class Bare:
        pass

    o = Bare()
    assert not implements(o, ThreadSafeLoads)
    o.try_batched_get_into_threadsafe = lambda keys, outs: None  # type: ignore[attr-defined]
    assert implements(o, ThreadSafeLoads)
    assert not implements(Bare(), ThreadSafeLoads)  # not remembered for the class
    assert implements(CPUBackend({"max_bytes": "1MiB"}), ThreadSafeLoads)  # remembered
    assert implements(CPUBackend({"max_bytes": "1MiB"}), ThreadSafeLoads)


# ----------------------------------------------------------------- each diagnostic
def test_a_missing_required_method_is_named():
    (problem, caps) = check_backend_class(object).problems
    assert problem == (
        "builtins.object is not a storage backend: missing start, close, contains, get, "
        "get_into, put, remove, batched_contains, batched_get, batched_get_into, "
        "batched_put, stats (subclass lmcache_core.backend.BaseBackend or "
        "lmcache_core.blob.BlobBackend)"
    )
    assert (
        caps
        == "builtins.object.capabilities must be a lmcache_core.interface.Capabilities (got NoneType)"
    )


def test_a_sync_method_where_the_protocol_says_async_is_named():
    assert check_backend_class(bad.SyncPutBackend).problems == [
        "lmcfix_iface_backends.SyncPutBackend.put must be a coroutine function (async def)"
    ]


def test_a_capability_implemented_in_part_is_named():
    assert check_backend_class(bad.HalfPinsBackend).problems == [
        "lmcfix_iface_backends.HalfPinsBackend implements part of Pinning (pins): has pin "
        "but not unpin"
    ]


def test_a_capability_without_the_one_it_needs_is_named():
    assert check_backend_class(bad.ReconcileOnlyBackend).problems == [
        "lmcfix_iface_backends.ReconcileOnlyBackend implements Reconcilable (reconcile) "
        "without MaintainableBackend: add scan, verify_entry, delete_entry"
    ]


def test_an_unsupported_interface_version_names_the_supported_range(monkeypatch):
    assert check_backend_class(bad.FutureBackend).problems == [
        "lmcfix_iface_backends.FutureBackend implements backend interface 2.0, but this "
        "lmcache-core supports backend interface 1.0 to 1.2"
    ]
    assert interface_version_problem("1.0") is None
    assert interface_version_problem(None) is None
    assert interface_version_problem("one") == (
        "declares interface_version 'one', which is not 'major.minor' "
        "(this lmcache-core supports backend interface 1.0 to 1.2)"
    )
    monkeypatch.setattr(interface, "INTERFACE_VERSION", "1.2")
    monkeypatch.setattr(interface, "MIN_INTERFACE_VERSION", "1.1")
    assert interface_version_problem("1.2") is None
    for old_or_new in ("1.0", "1.3", "0.9"):
        assert interface_version_problem(old_or_new) == (
            f"implements backend interface {old_or_new}, but this lmcache-core supports "
            "backend interface 1.1 to 1.2"
        )


def test_an_undeclared_interface_version_is_a_warning_only():
    check = check_backend_class(FixtureBackend)
    assert check.problems == []
    assert check.warnings == [
        'lmcfix_backend.FixtureBackend declares no interface_version (add `interface_version = "1.2"`); assuming 1.2'
    ]


def test_registering_a_class_checks_it():
    reg = BackendRegistry()
    with pytest.raises(PluginError) as ei:
        reg.add(bad.HalfPinsBackend, name="halfpins")
    assert str(ei.value) == (
        "backend 'halfpins': lmcfix_iface_backends.HalfPinsBackend implements part of Pinning "
        "(pins): has pin but not unpin"
    )
    assert "halfpins" not in reg
    reg.add(bad.ThreadSafeContainsBackend, name="ok")  # a complete capability is fine
    assert "ok" in reg


def test_a_configured_class_is_checked_where_it_is_named():
    with pytest.raises(ConfigError) as ei:
        load_config({"tiers": [{"backend_class": "lmcfix_iface_backends:FutureBackend"}]})
    assert ei.value.path == "tiers[0].backend_class"
    assert str(ei.value) == (
        "tiers[0].backend_class: lmcfix_iface_backends.FutureBackend implements backend "
        "interface 2.0, but this lmcache-core supports backend interface 1.0 to 1.2"
    )


def test_sync_facade_names_the_missing_protocol():
    sb = SyncBackend(CPUBackend({"max_bytes": "1MiB"}))
    try:
        sb.start()
        with pytest.raises(TypeError) as ei:
            sb.release([])
        assert str(ei.value) == (
            "backend 'cpu' does not implement PrefixLookups (lookup_prefix, release)"
        )
    finally:
        sb.close()


# ----------------------------------------------------------------- the CLI
def test_backends_and_strict_plugins_show_the_interface_check(tmp_path):
    write_dist_info(tmp_path, "lmcfix-iface", "lmcfix_iface", version="0.4")
    listing = json.loads(run("backends", "--json", path=tmp_path).stdout)["backends"]
    future = by_name(listing, "future")
    assert future["status"] == "failed"
    assert future["error"] == (
        "TypeError: lmcfix_iface_backends.FutureBackend implements backend interface 2.0, "
        "but this lmcache-core supports backend interface 1.0 to 1.2"
    )
    assert by_name(listing, "halfpins")["error"].endswith("has pin but not unpin")
    ok = by_name(listing, "tscontains")
    assert ok["status"] == "ok"
    assert ok["interface"] == {"version": "1.0", "optional": ["ThreadSafeContains"], "warnings": []}
    cpu = by_name(listing, "cpu")["interface"]
    assert cpu["version"] == "1.2" and "Pinning" in cpu["optional"]

    table = run("backends", "tscontains", "--table", path=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "  interface: 1.0\n  optional protocols: ThreadSafeContains\n" in table.stdout

    strict = run("plugins", "--strict", "--table", path=tmp_path)
    assert strict.returncode == 1
    assert "backend interface 1.2 (loads 1.0 to 1.2)" in strict.stdout
    assert (
        "lmcfix-iface: failed: backend 'future': lmcfix_iface_backends.FutureBackend implements "
        "backend interface 2.0, but this lmcache-core supports backend interface 1.0 to 1.2"
    ) in strict.stdout
    assert (
        "lmcfix-iface: failed: backend 'halfpins': lmcfix_iface_backends.HalfPinsBackend "
        "implements part of Pinning (pins): has pin but not unpin"
    ) in strict.stdout


def test_backends_warns_about_an_undeclared_interface_version(tmp_path):
    write_dist_info(tmp_path, "lmcfix-good", "lmcfix_good")
    res = run("backends", "fixture", "--table", path=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (
        "  interface: undeclared\n  optional protocols: none\n  warning: "
        "lmcfix_backend.FixtureBackend declares no interface_version"
    ) in res.stdout


# ----------------------------------------------------------------- no probing left
def test_no_capability_is_probed_by_name():
    """Every optional method is reached through interface.implements, never getattr/hasattr."""
    names = {m for p in OPTIONAL_PROTOCOLS for m in interface.missing_members(object(), p)}
    names |= set(REQUIRED_METHODS) | {"capabilities", "pins_do_io"}
    probe = re.compile(r"""\b(?:getattr|hasattr)\(\s*[^,()]+,\s*["'](\w+)["']""")
    found = []
    sources = [*ROOT.glob("lmcache_core/**/*.py"), *ROOT.glob("backends/*/src/**/*.py")]
    for path in sources:
        if path.name == "interface.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in probe.finditer(line):
                if m.group(1) in names:
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_the_protocol_page_shows_the_module():
    from lmcache_core.interface_docs import BEGIN, END, render_interface_block

    page = ROOT / "docs" / "plugins" / "backend-protocol.md"
    text = page.read_text(encoding="utf-8")
    assert BEGIN in text and END in text
    assert render_interface_block(text) == text, (
        "docs/plugins/backend-protocol.md is stale: run "
        "`python -m lmcache_core.interface_docs docs/plugins/backend-protocol.md`"
    )
    for proto in OPTIONAL_PROTOCOLS:
        assert f"class {proto.__name__}(Protocol):" in text
