"""LMCache compatibility: configuration translation, ``config from-lmcache``, the connector
reading an LMCache configuration, the docs' translation table, ``torch.dtype`` in keys.

The example files in ``tests/data/lmcache/`` are written for these tests from LMCache's
documented keys (not copied from LMCache).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_config_cli import cli

from lmcache_core.cli.main import main as cli_main
from lmcache_core.config import load_config
from lmcache_core.config.lmcache_compat import (
    LMCACHE_ALIASES,
    LMCACHE_KEYS,
    from_lmcache,
    read_lmcache_file,
    translation_markdown,
)
from lmcache_core.errors import ConfigError, KeyFormatError
from lmcache_core.integrations.vllm.settings import parse_settings
from lmcache_core.keys import CacheEngineKey
from lmcache_core.token_db import ChunkedTokenDatabase

DATA = Path(__file__).resolve().parent / "data" / "lmcache"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"
GIB = 1 << 30
THROUGH = {"policy": "through"}

#: Each example: the native configuration, connector options and keys not honoured.
EXPECTED: dict[str, tuple[dict[str, Any], dict[str, Any], list[str]]] = {
    "cpu_only.yaml": (
        {
            "chunk_size": 256,
            "hash_algorithm": "xxh3_128",
            "tiers": [{"name": "cpu", "backend": "cpu", "options": {"max_bytes": "5GiB"}}],
        },
        {},
        [],
    ),
    "cpu_disk.yaml": (
        {
            "chunk_size": 256,
            "hash_algorithm": "sha256",
            "tiers": [
                {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "2GiB"}},
                {
                    "name": "disk",
                    "backend": "disk",
                    "options": {
                        "path": "/tmp/lmcache/disk/",
                        "max_bytes": "20GiB",
                        "pin_seconds": 120.0,
                    },
                    "write": THROUGH,
                },
            ],
        },
        {"save_decode_chunks": True},
        [],
    ),
    "gds.yaml": (
        {
            "chunk_size": 256,
            "hash_algorithm": "xxh3_128",
            "tiers": [
                {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "4GiB"}},
                {
                    "name": "disk",
                    "backend": "disk",
                    "options": {"path": "/tmp/lmcache/disk", "max_bytes": "8GiB"},
                    "write": THROUGH,
                },
                {
                    "name": "gds",
                    "backend": "gds",
                    "options": {"paths": ["/mnt/nvme0/lmcache", "/mnt/nvme1/lmcache"]},
                    "write": THROUGH,
                },
            ],
        },
        {},
        ["gds_path"],
    ),
    "s3_remote.yaml": (
        {
            "chunk_size": 512,
            "hash_algorithm": "xxh3_128",
            "tiers": [
                {"name": "cpu", "backend": "cpu", "options": {"max_bytes": GIB // 2}},
                {
                    "name": "remote",
                    "backend": "s3://kv-bucket",
                    "options": {"region": "us-west-2", "max_concurrency": 64},
                    "load_deadline_ms": 3000.0,
                    "write": THROUGH,
                },
            ],
        },
        {"lookup_deadline_ms": 500.0},
        ["extra_config.aws_access_key_id"],
    ),
    "shared_fs.yaml": (
        {
            "chunk_size": 256,
            "hash_algorithm": "xxh3_128",
            "tiers": [
                {
                    "name": "remote",
                    "backend": "disk",
                    "options": {"path": "/mnt/shared/lmcache"},
                    "write": THROUGH,
                }
            ],
        },
        {},
        [
            "enable_controller",
            "controller_pull_url",
            "enable_p2p",
            "p2p_host",
            "enable_blending",
            "cache_policy",
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_examples_translate_field_by_field(name: str) -> None:
    storage, connector, not_honoured = EXPECTED[name]
    tr = from_lmcache(read_lmcache_file(DATA / name))
    assert tr.storage == storage
    assert tr.connector == connector
    assert [k for k, _ in tr.not_honoured] == not_honoured
    warning = tr.warning()
    if not_honoured:
        assert warning is not None
        for key in not_honoured:
            assert key in warning
    else:
        assert warning is None


def _tiers(cfg: Any) -> list[dict[str, Any]]:
    tiers: list[dict[str, Any]] = cfg.to_dict()["tiers"]
    return tiers


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> Run:
    """``lmcache-core ARGS`` in this process (the console script's own entry point)."""
    code = cli_main(list(args))
    out = capsys.readouterr()
    return Run(code, out.out, out.err)


def test_console_script_translates(tmp_path: Path) -> None:
    r = cli("config", "from-lmcache", str(DATA / "cpu_disk.yaml"))
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout) == EXPECTED["cpu_disk.yaml"][0]
    j = cli("config", "from-lmcache", "--json", str(DATA / "s3_remote.yaml"))
    doc = json.loads(j.stdout)
    assert doc["storage"] == EXPECTED["s3_remote.yaml"][0]
    assert doc["connector"] == EXPECTED["s3_remote.yaml"][1]
    assert [n["key"] for n in doc["not_honoured"]] == EXPECTED["s3_remote.yaml"][2]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_printed_yaml_reloads_to_the_same_tiers(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = run_cli(capsys, "config", "from-lmcache", str(DATA / name))
    assert r.returncode == 0, r.stderr
    native = tmp_path / "native.yaml"
    native.write_text(r.stdout)
    assert yaml.safe_load(r.stdout) == EXPECTED[name][0]
    reloaded = load_config(native)
    direct = load_config(EXPECTED[name][0])
    assert _tiers(reloaded) == _tiers(direct)
    sizes = {
        "5GiB": 5 * GIB,
        "4GiB": 4 * GIB,
        "2GiB": 2 * GIB,
        "8GiB": 8 * GIB,
        "20GiB": 20 * GIB,
        GIB // 2: GIB // 2,
    }
    for got, want in zip(_tiers(reloaded), EXPECTED[name][0]["tiers"], strict=True):
        assert (got["name"], got["write"]["policy"]) == (want["name"], "through")
        for opt, value in want.get("options", {}).items():
            want_value = sizes.get(value, value) if isinstance(value, (str, int)) else value
            assert got["options"][opt] == want_value, (opt, got["options"])
    assert (reloaded.chunk_size, reloaded.hash_algorithm) == (
        direct.chunk_size,
        direct.hash_algorithm,
    )
    check = run_cli(capsys, "config", "check", str(native))
    assert check.returncode == 0, check.stderr
    not_honoured = EXPECTED[name][2]
    if not_honoured:
        assert "not honoured" in r.stderr and all(k in r.stderr for k in not_honoured)
        assert r.stderr.count("warning:") == 1
    else:
        assert r.stderr == ""
    if EXPECTED[name][1]:
        assert "kv_connector_extra_config" in r.stdout  # the connector options, as a comment


def test_cli_refuses_a_file_it_cannot_translate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "lmc.yaml"
    bad.write_text("local_cpu: false\nremote_url: redis://localhost:6379\n")
    r = run_cli(capsys, "config", "from-lmcache", str(bad))
    assert r.returncode == 1
    assert "selects no storage" in r.stderr and r.stdout == ""
    bad.write_text("- not a mapping\n")
    assert run_cli(capsys, "config", "from-lmcache", str(bad)).returncode == 1
    assert run_cli(capsys, "config", "from-lmcache", str(tmp_path / "missing.yaml")).returncode == 1


def test_overrides_and_environment_take_precedence_over_the_file() -> None:
    doc = read_lmcache_file(DATA / "cpu_disk.yaml")
    tr = from_lmcache(
        doc,
        overrides={"chunk_size": 128},
        environ={"LMCACHE_MAX_LOCAL_CPU_SIZE": "1.5", "LMCACHE_CHUNK_SIZE": "64"},
    )
    assert tr.storage["chunk_size"] == 128  # lmcache.* entries win over the environment
    assert tr.storage["tiers"][0]["options"]["max_bytes"] == int(1.5 * GIB)


def test_unknown_keys_aliases_and_bad_values() -> None:
    tr = from_lmcache({"nixl_role": "sender", "not_a_key": 1})
    keys = [k for k, _ in tr.not_honoured]
    assert keys == ["not_a_key", "pd_role"]  # the alias is read as its key
    with pytest.raises(ConfigError) as exc:
        from_lmcache({"max_local_cpu_size": "lots"})
    assert exc.value.path == "max_local_cpu_size"
    with pytest.raises(ConfigError):
        from_lmcache({"local_cpu": "maybe"})
    # a disk without size is no disk in LMCache: said, not silently dropped
    tr = from_lmcache({"local_disk": "/tmp/x", "max_local_disk_size": 0})
    assert [t["name"] for t in tr.storage["tiers"]] == ["cpu"]
    assert [k for k, _ in tr.not_honoured] == ["local_disk"]


def test_gds_path_becomes_a_gds_tier() -> None:
    # one directory: `path`; use_gds false: the POSIX path; the tier evicts (LMCache's
    # never does), which the warning says
    tr = from_lmcache({"local_cpu": False, "gds_path": "file:///mnt/nvme0/kv", "use_gds": False})
    assert tr.storage["tiers"] == [
        {
            "name": "gds",
            "backend": "gds",
            "options": {"path": "/mnt/nvme0/kv", "force_posix": True},
            "write": THROUGH,
        }
    ]
    assert [k for k, _ in tr.not_honoured] == ["gds_path"]
    assert "never evicts" in (tr.warning() or "")
    # below the disk tier and above a remote one, as LMCache orders its backends
    tr = from_lmcache(
        {
            "local_disk": "/d",
            "max_local_disk_size": 1,
            "gds_path": "/g",
            "remote_url": "s3://bucket",
            "gds_backend": "hipfile",
        }
    )
    assert [t["name"] for t in tr.storage["tiers"]] == ["cpu", "disk", "gds", "remote"]
    assert [k for k, _ in tr.not_honoured] == ["gds_backend", "gds_path"]
    # the defaults of the gds keys alone select nothing
    tr = from_lmcache({"gds_path_sharding": "by_gpu", "use_gds": True, "gds_backend": "cufile"})
    assert [t["name"] for t in tr.storage["tiers"]] == ["cpu"] and not tr.not_honoured
    with pytest.raises(ConfigError):
        from_lmcache({"local_cpu": False, "gds_path": " , "})


def test_the_table_covers_every_key_once_and_the_docs_embed_it() -> None:
    names = [k.name for k in LMCACHE_KEYS]
    assert len(names) == len(set(names)) == 108  # LMCache 0.5.6's configuration
    assert not set(LMCACHE_ALIASES) & set(names)
    assert set(LMCACHE_ALIASES.values()) <= set(names)
    for k in LMCACHE_KEYS:
        assert k.kind in ("mapped", "ignored", "not honoured"), k
        assert k.target if k.kind == "mapped" else k.why, k
    text = DOCS.read_text()
    begin, end = "<!-- lmcache-translation:start -->", "<!-- lmcache-translation:end -->"
    block = text[text.index(begin) + len(begin) : text.index(end)]
    assert block.strip() == translation_markdown().strip()


# ----------------------------------------------------------------- the connector's settings
def test_connector_reads_an_lmcache_file(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.lmcache_core.connector"):
        s = parse_settings({"lmcache_config_file": str(DATA / "shared_fs.yaml")}, environ={})
    assert s.storage == EXPECTED["shared_fs.yaml"][0]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert all(k in warnings[0].getMessage() for k in EXPECTED["shared_fs.yaml"][2])


def test_connector_takes_lmcache_config_file_from_the_environment() -> None:
    env = {"LMCACHE_CONFIG_FILE": str(DATA / "cpu_disk.yaml"), "LMCACHE_CHUNK_SIZE": "128"}
    s = parse_settings({"stats_dir": "/tmp/s"}, environ=env)
    assert s.storage["chunk_size"] == 128
    assert s.storage["tiers"][1]["options"]["path"] == "/tmp/lmcache/disk/"
    assert s.options.save_decode_chunks is True  # save_decode_cache: true
    assert "cpu_disk.yaml" in s.source
    # a native configuration wins over the variable (and ignores LMCACHE_* variables)
    native = parse_settings({"config": {"chunk_size": 32, "tiers": []}}, environ=env)
    assert native.storage["chunk_size"] == 32
    assert parse_settings({}, environ={}).source == "<default>"


def test_connector_lmcache_prefixed_keys_and_explicit_options() -> None:
    s = parse_settings(
        {
            "lmcache_config_file": str(DATA / "cpu_disk.yaml"),
            "lmcache.chunk_size": 64,
            "lmcache.save_decode_cache": True,
            "save_decode_chunks": False,  # a native option beats the translated one
        },
        environ={},
    )
    assert s.storage["chunk_size"] == 64
    assert s.options.save_decode_chunks is False
    only_keys = parse_settings({"lmcache.local_cpu": True}, environ={})
    assert only_keys.storage["tiers"] == [
        {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "5GiB"}}
    ]
    with pytest.raises(ConfigError) as exc:
        parse_settings({"config": {}, "lmcache_config_file": "x.yaml"}, environ={})
    assert "once" in str(exc.value)
    with pytest.raises(ConfigError):
        parse_settings({"lmcache_config_file": "/nonexistent/lmc.yaml"}, environ={})


# ----------------------------------------------------------------------- torch.dtype in keys
def test_keys_and_token_database_accept_torch_dtypes() -> None:
    a = CacheEngineKey("m", 1, 0, 5, torch.bfloat16)
    assert a == CacheEngineKey("m", 1, 0, 5, "bfloat16")
    assert a.dtype == "bfloat16"
    assert CacheEngineKey("m", 1, 0, 5, torch.half).dtype == "float16"
    assert CacheEngineKey.from_string(a.to_string()) == a
    with pytest.raises(KeyFormatError, match=r"torch\.dtype"):
        CacheEngineKey("m", 1, 0, 5, 3)  # type: ignore[arg-type]
    tokens = list(range(16))
    db_t = ChunkedTokenDatabase(chunk_size=8, model_name="m", dtype=torch.float32)
    db_s = ChunkedTokenDatabase(chunk_size=8, model_name="m", dtype="float32")
    assert db_t.keys(tokens) == db_s.keys(tokens)
    assert db_t.namespace == db_s.namespace
    assert db_t.keys(tokens)[0].dtype == "float32"
    assert db_t.keys(tokens) != ChunkedTokenDatabase(chunk_size=8, dtype=torch.float16).keys(tokens)
