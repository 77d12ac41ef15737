"""``lmcache-core verify`` and ``gc`` on a disk tier, through the real command line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from disk_testutil import object_files, run
from lmcache_backend_disk import DiskBackend
from lmcache_backend_disk.layout import INDEX_FILE, META_DIR

from lmcache_core import CacheEngineKey, Namespace
from lmcache_core.cli.main import main
from lmcache_core.testing import random_tensor, same_bits

NS_A = Namespace(model_name="model-a")
NS_B = Namespace(model_name="model-b")


def cli(*args: str) -> tuple[int, Any, str]:
    """Run ``lmcache-core ARGS`` in this process; (exit status, parsed JSON or None, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    try:
        doc = json.loads(out.getvalue()) if out.getvalue().strip() else None
    except ValueError:
        doc = None
    return rc, doc, err.getvalue()


def _key(model: str, i: int) -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, i + 1, "uint8")


def _fill(root: str, per_model: int = 10, nbytes: int = 10_000) -> dict[str, list[CacheEngineKey]]:
    keys: dict[str, list[CacheEngineKey]] = {}

    async def body() -> None:
        for ns in (NS_A, NS_B):
            b = DiskBackend({"path": root}, namespace=ns)
            await b.start()
            try:
                ks = [_key(ns.model_name, i) for i in range(per_model)]
                vals = [random_tensor((nbytes,), torch.uint8, seed=i) for i in range(per_model)]
                assert all(await b.batched_put(ks, vals))
                keys[ns.model_name] = ks
            finally:
                await b.close()

    run(body())
    return keys


def _set_atimes(root: str, when: float, prefix: str = "") -> None:
    con = sqlite3.connect(os.path.join(root, META_DIR, INDEX_FILE))
    try:
        with con:
            con.execute("UPDATE entries SET atime = ? WHERE path LIKE ?", (when, prefix + "%"))
    finally:
        con.close()


def _corrupt_one(root: str) -> str:
    rel = sorted(object_files(root))[0]
    path = os.path.join(root, rel)
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    return rel


def test_verify_reports_and_deletes_bad_objects(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")
    _fill(root)
    rc, doc, _ = cli("verify", "--path", root, "--json")
    assert rc == 0 and doc["verify"][0]["checked"] == 20 and doc["verify"][0]["bad"] == 0
    rel = _corrupt_one(root)
    rc, doc, _ = cli("verify", "--path", root, "--json")
    assert rc == 1
    bad = doc["verify"][0]["bad_objects"]
    assert [b["location"] for b in bad] == [rel] and "checksum" in bad[0]["reason"]
    assert os.path.exists(os.path.join(root, rel)), "verify without --delete changes nothing"
    rc, doc, _ = cli("verify", "--path", root, "--delete", "--json")
    assert rc == 0 and doc["verify"][0]["deleted"] == 1
    assert not os.path.exists(os.path.join(root, rel))
    assert len(object_files(root)) == 19


def test_gc_trims_to_max_bytes_least_recently_used_first(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")
    keys = _fill(root)
    _set_atimes(root, time.time() - 1000)

    async def touch() -> None:  # model-b's entries become the most recently used
        b = DiskBackend({"path": root, "touch_interval": 0}, namespace=NS_B)
        await b.start()
        try:
            for k in keys["model-b"]:
                assert await b.get(k) is not None
        finally:
            await b.close()

    run(touch())
    size = next(iter(object_files(root).values()))
    rc, doc, _ = cli("gc", "--path", root, "--max-bytes", str(12 * size), "--dry-run", "--json")
    assert rc == 0 and doc["gc"][0]["trimmed"]["entries"] == 8
    assert len(object_files(root)) == 20, "a dry run deletes nothing"
    rc, doc, _ = cli("gc", "--path", root, "--max-bytes", str(12 * size), "--json")
    assert rc == 0 and doc["gc"][0]["remaining"]["entries"] == 12
    files = object_files(root)
    assert sum(files.values()) <= 12 * size

    async def check() -> None:
        b = DiskBackend({"path": root}, namespace=NS_B)
        await b.start()
        try:
            assert all(await b.batched_contains(keys["model-b"])), "recently used entries survive"
        finally:
            await b.close()

    run(check())


def test_gc_expires_and_purges(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")
    _fill(root)
    ns_dirs = sorted({rel.split("/")[0] for rel in object_files(root)})
    assert len(ns_dirs) == 2
    _set_atimes(root, time.time() - 3 * 86400, prefix=ns_dirs[0])
    rc, doc, _ = cli("gc", "--path", root, "--older-than", "2d", "--json")
    assert rc == 0 and doc["gc"][0]["expired"]["entries"] == 10
    assert {rel.split("/")[0] for rel in object_files(root)} == {ns_dirs[1]}
    _fill(root)  # both again
    rc, doc, _ = cli("gc", "--path", root, "--model", "model-a", "--json")
    assert rc == 0 and doc["gc"][0]["purged"]["entries"] == 10
    rc, doc, _ = cli("gc", "--path", root, "--namespace", NS_B.to_json(), "--json")
    assert rc == 0 and doc["gc"][0]["purged"]["entries"] == 10
    assert object_files(root) == {}
    _fill(root)
    rc, doc, _ = cli("gc", "--path", root, "--namespace", ns_dirs[0], "--json")
    assert rc == 0 and doc["gc"][0]["purged"]["entries"] == 10


def test_gc_settles_crash_leftovers(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")
    _fill(root, per_model=2)
    shard = os.path.dirname(sorted(object_files(root))[0])
    stale = os.path.join(root, shard, f".{'a' * 32}.{'b' * 16}.3.tmp")
    with open(stale, "wb") as f:
        f.write(b"half an object")  # its writer (owner bbbb...) does not exist
    rc, doc, _ = cli("gc", "--path", root, "--json")
    assert rc == 0 and doc["gc"][0]["reconciled"]["removed_temps"] == 1
    assert not os.path.exists(stale)


def test_config_targets_and_errors(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")
    keys = _fill(root, per_model=3)
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(
        f"tiers:\n  - {{name: hot, backend: cpu}}\n  - {{name: warm, backend: 'file://{root}'}}\n"
    )
    rc, doc, err = cli("verify", "--config", str(cfg), "--json")
    assert rc == 0, err
    rows = {r["tier"]: r for r in doc["verify"]}
    assert "skipped" in rows["hot"] and rows["warm"]["checked"] == 6
    rc, doc, _ = cli("gc", "--config", str(cfg), "--tier", "warm", "--model", "model-b", "--json")
    assert rc == 0 and [r["tier"] for r in doc["gc"]] == ["warm"]
    assert doc["gc"][0]["purged"]["entries"] == 3
    rc, _, err = cli("gc", "--config", str(cfg), "--tier", "nope", "--json")
    assert rc == 2 and "no tier named" in err
    rc, _, err = cli("verify", "--path", str(tmp_path), "--json")
    assert rc == 2 and "not a disk tier" in err
    rc, _, err = cli("gc", "--path", root, "--older-than", "soon", "--json")
    assert rc == 2 and "duration" in err

    async def check() -> None:  # what gc left is intact
        b = DiskBackend({"path": root}, namespace=NS_A)
        await b.start()
        try:
            for i, k in enumerate(keys["model-a"]):
                assert same_bits(await b.get(k), random_tensor((10_000,), torch.uint8, seed=i))
        finally:
            await b.close()

    run(check())


def test_progress_bar_on_request(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")
    _fill(root, per_model=40)
    rc, _, err = cli("verify", "--path", root, "--progress", "--json")
    assert rc == 0 and "\r" in err and "80/80" in err
    rc, _, err = cli("verify", "--path", root, "--json")  # stderr is not a terminal here
    assert rc == 0 and "\r" not in err


def test_console_script_runs_verify(tmp_path: Path) -> None:
    """The installed ``lmcache-core`` entry point reaches these commands."""
    root = str(tmp_path / "tier")
    _fill(root, per_model=2)
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache_core.cli", "verify", "--path", root, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verify"][0]["checked"] == 4


def test_damaged_index_is_healed_and_reported_never_a_traceback(tmp_path: Path) -> None:
    """A corrupted index, crafted rows and a refused root: verify/gc report, never raise."""
    root = str(tmp_path / "tier")
    _fill(root, per_model=5)
    index = os.path.join(root, META_DIR, INDEX_FILE)
    with open(index, "r+b") as f:  # the index's root pages zeroed
        f.seek(4096)
        f.write(bytes(8192))
    rc, doc, err = cli("verify", "--path", root, "--json")
    assert rc == 0 and doc["verify"][0]["checked"] == 10 and doc["verify"][0]["bad"] == 0, err
    assert "Traceback" not in err
    con = sqlite3.connect(index)
    with con:
        con.execute("INSERT INTO entries VALUES ('../../etc/passwd', -5, 0)")
        con.execute("INSERT INTO pending(owner, path, tmp, size, started) VALUES "
                    "('/etc', 'x', 'y', 1, 0)")  # fmt: skip
        con.execute("UPDATE totals SET used = -1")
    con.close()
    rc, doc, err = cli("gc", "--path", root, "--json")
    assert rc == 0 and "Traceback" not in err, err
    assert doc["gc"][0]["remaining"]["entries"] == 10
    rc, doc, _ = cli("verify", "--path", root, "--json")
    assert rc == 0 and doc["verify"][0]["bad"] == 0
    os.chmod(root, 0o777)  # now anyone could plant files in it: refused, reported
    try:
        rc, doc, err = cli("verify", "--path", root, "--json")
        assert rc == 1 and "Traceback" not in err
        assert "writable by every user" in doc["verify"][0]["error"]
    finally:
        os.chmod(root, 0o700)
