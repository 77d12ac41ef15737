"""`lmcache-core config check|show|schema`, run as real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

TESTS = Path(__file__).resolve().parent


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lmcache-core")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "lmcache_core.cli"]
    full_env = {**os.environ, "PYTHONPATH": str(TESTS), **(env or {})}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=full_env,
                          timeout=120, check=False)  # fmt: skip


def write(tmp_path: Path, doc: Any, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc) if name.endswith(".yaml") else json.dumps(doc))
    return p


def test_check_accepts_a_valid_file_and_opens_nothing(tmp_path: Path) -> None:
    store = tmp_path / "store"  # the scannable backend creates it when started
    marker = tmp_path / "imported"  # written when the backend_class module is imported
    (tmp_path / "marking_backend.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom test_hierarchy_fakes import ScannableBackend\n"
    )
    env = {"PYTHONPATH": f"{TESTS}{os.pathsep}{tmp_path}"}
    doc = {
        "tiers": [
            {"name": "hot", "backend": "cpu", "options": {"max_bytes": "1GiB"}},
            {"name": "files", "backend_class": "marking_backend:ScannableBackend",
             "options": {"path": str(store)}, "write": {"policy": "back", "admit_after": 2}},
        ]
    }  # fmt: skip
    path = write(tmp_path, doc)
    res = cli("config", "check", str(path), "--table", env=env)
    assert res.returncode == 0, res.stderr
    assert "OK, 2 tier(s): hot (cpu, through) -> files (" in res.stdout
    assert "back, admit_after=2)" in res.stdout
    assert "not imported" in res.stdout
    assert not marker.exists(), "config check must not import backend_class modules"
    res = cli("config", "check", str(path), "--import", env=env)  # piped: JSON
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["tiers"][1]["write_policy"] == "back" and out["not_imported"] == []
    assert marker.exists(), "--import imports (and so validates) backend_class modules"
    assert not store.exists(), "config check must not start backends"


def test_check_reports_the_error_path(tmp_path: Path) -> None:
    path = write(tmp_path, {"tiers": [{"backend": "cpu", "options": {"max_bytes": "lots"}}]},
                 name="bad.json")  # fmt: skip
    res = cli("config", "check", str(path), "--json")
    assert res.returncode == 1
    out = json.loads(res.stdout)
    assert out["ok"] is False and out["path"] == "tiers[0].options.max_bytes"
    res = cli("config", "check", str(path), "--table")
    assert res.returncode == 1
    assert "tiers[0].options.max_bytes: cannot parse byte size 'lots'" in res.stderr
    res = cli("config", "check", str(tmp_path / "absent.yaml"))
    assert res.returncode == 1 and "does not exist" in res.stdout


def test_show_resolves_defaults_and_redacts_secrets(tmp_path: Path) -> None:
    doc = {
        "hash_salt": {"$env": "CLI_TEST_SALT"},
        "tiers": [{"name": "hot", "backend": "cpu",
                   "options": {"max_bytes": {"$env": "CLI_TEST_SIZE"}}}],
    }  # fmt: skip
    path = write(tmp_path, doc)
    env = {"CLI_TEST_SALT": "sup3r-s3cret", "CLI_TEST_SIZE": "3GiB"}
    res = cli("config", "show", str(path), "--json", env=env)
    assert res.returncode == 0, res.stderr
    assert "sup3r-s3cret" not in res.stdout
    shown = json.loads(res.stdout)
    assert shown["hash_salt"] == "<redacted>"
    assert shown["chunk_size"] == 256
    tier = shown["tiers"][0]
    assert tier["options"]["max_bytes"] == "<redacted>"
    assert tier["options"]["pin_memory"] == "auto"  # defaults filled in
    assert tier["write"] == {"policy": "through", "admit_after": 1}
    res = cli("config", "show", str(path), "--table", env=env)
    assert res.returncode == 0 and "sup3r-s3cret" not in res.stdout
    assert yaml.safe_load(res.stdout)["tiers"][0]["name"] == "hot"
    res = cli("config", "show", str(path), "--json")  # variable not set
    assert res.returncode == 1
    assert json.loads(res.stdout)["path"] == "hash_salt"


def test_schema_prints_and_refreshes_the_docs(tmp_path: Path) -> None:
    res = cli("config", "schema")
    assert res.returncode == 0
    assert "| `write.admit_after` |" in res.stdout and "| `lookup_deadline_ms` |" in res.stdout
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- lmcache-core:config-schema -->\nSTALE-TABLE\n"
                   "<!-- /lmcache-core:config-schema -->\nend\n")  # fmt: skip
    res = cli("config", "schema", "--write-docs", str(doc))
    assert res.returncode == 0 and "updated" in res.stdout
    text = doc.read_text()
    assert "STALE-TABLE" not in text and "| `chunk_size` |" in text and text.endswith("end\n")
    assert "up to date" in cli("config", "schema", "--write-docs", str(doc)).stdout
