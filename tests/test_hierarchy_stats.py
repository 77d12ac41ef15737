"""Statistics: latency percentiles, per-tier counters, stats files and `lmcache-core inspect`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from test_hierarchy_fakes import make_registry

from lmcache_core import TieredHierarchy
from lmcache_core.backends.host_buffers import ENTRY_OVERHEAD
from lmcache_core.hierarchy.stats import LatencyReservoir, read_stats_dir, write_json_atomic
from lmcache_core.testing import make_key, random_tensor, run_async

TESTS = Path(__file__).resolve().parent


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lmcache-core")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "lmcache_core.cli"]
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, env=env,
                          timeout=120, check=False)  # fmt: skip


def test_latency_reservoir_percentiles_and_bound() -> None:
    r = LatencyReservoir(capacity=100)
    assert r.percentiles() == {"p50_ms": None, "p90_ms": None, "p99_ms": None}
    for ms in range(1, 101):  # 1..100 ms
        r.add(ms / 1000)
    assert r.percentiles() == {"p50_ms": 50.0, "p90_ms": 90.0, "p99_ms": 99.0}
    for _ in range(100):  # the reservoir keeps only the latest samples
        r.add(0.5)
    assert r.percentiles()["p50_ms"] == 500.0
    assert r.count == 200 and len(r._samples) == 100


def test_per_tier_statistics() -> None:
    async def body() -> None:
        hot_bytes = 4 * (256 * 1024 + ENTRY_OVERHEAD)  # four entries
        cfg = {"tiers": [{"name": "hot", "backend": "cpu", "options": {"max_bytes": hot_bytes}},
                         {"name": "warm", "backend": "cpu"}]}  # fmt: skip
        async with TieredHierarchy.from_config(cfg, registry=make_registry()) as h:
            keys = [make_key(f"s{i}") for i in range(6)]
            for i, k in enumerate(keys):
                await h.put(k, random_tensor((256 * 1024,), torch.uint8, i))
            await h.flush()
            await h.get(keys[0])  # evicted from hot: a warm hit
            await h.get(keys[5])  # a hot hit
            await h.get(make_key("none"))
            await h.lookup_prefix(keys)
            s = h.stats()
            hot, warm = s["tiers"]
            assert (s["hits"], s["misses"]) == (2, 1)
            assert (hot["hits"], hot["misses"]) == (1, 2)
            assert (warm["hits"], warm["misses"]) == (1, 1)
            assert warm["bytes_out"] == 256 * 1024 and warm["bytes_in"] == 6 * 256 * 1024
            # six puts and the warm hit's promotion (published into memory the full hot
            # tier recycled, during the get)
            assert hot["bytes_in"] == 7 * 256 * 1024 and hot["promotions"] == 1
            assert warm["load_latency"]["count"] == 2 and warm["load_latency"]["p99_ms"] > 0
            assert warm["store_latency"]["count"] == 6
            assert warm["queue_wait"]["count"] == 6
            assert hot["lookup_latency"]["count"] == 1 and s["lookups"] == 1
            assert warm["queue_depth"] == 0 and warm["dropped_stores"] == 0
            assert warm["errors"] == 0 and warm["health"]["state"] == "ok"
            assert hot["backend_stats"]["entries"] == 4
            json.dumps(s)  # JSON-safe

    run_async(body())


def test_stats_file_is_written_atomically_and_removed_on_close(tmp_path: Path) -> None:
    async def body() -> None:
        cfg = {"stats_dir": str(tmp_path), "stats_interval_s": 0.05, "hash_salt": "hidden",
               "tiers": [{"name": "hot", "backend": "cpu"}]}  # fmt: skip
        h = TieredHierarchy.from_config(cfg, registry=make_registry())
        await h.start()
        key = make_key("f")
        await h.put(key, random_tensor((1024,), torch.uint8, 1))
        await h.get(key)
        path = tmp_path / f"{os.getpid()}.json"
        for _ in range(100):
            await asyncio.sleep(0.05)
            if path.exists() and json.loads(path.read_text())["stats"]["hits"] == 1:
                break
        doc = json.loads(path.read_text())
        assert doc["pid"] == os.getpid() and doc["stats"]["tiers"][0]["name"] == "hot"
        assert doc["config"]["hash_salt"] == "<redacted>" and "hidden" not in path.read_text()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
        # inspect sees this live engine
        res = await asyncio.to_thread(cli, "inspect", "--stats-dir", str(tmp_path), "--json")
        assert res.returncode == 0, res.stderr
        engines = json.loads(res.stdout)["engines"]
        assert len(engines) == 1 and engines[0]["alive"] is True
        assert engines[0]["stats"]["tiers"][0]["hits"] == 1
        table = await asyncio.to_thread(cli, "inspect", str(tmp_path), "--table")
        assert f"pid {os.getpid()}" in table.stdout and "(alive)" in table.stdout
        assert "hot" in table.stdout
        await h.close()
        assert not path.exists()

    run_async(body())


def test_a_write_still_in_its_thread_at_stop_does_not_bring_the_file_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI once found the file back after close: the periodic write was in its worker
    thread when stop() cancelled the task and removed the file, and its rename landed
    after. Here the write is held in its thread while stop() runs."""
    import threading

    from lmcache_core.hierarchy import stats as stats_mod

    in_write = threading.Event()
    real = stats_mod.write_json_atomic

    def slow_write(path: Path, data: object) -> None:
        in_write.set()
        time.sleep(0.3)
        real(path, data)

    monkeypatch.setattr(stats_mod, "write_json_atomic", slow_write)

    async def body() -> None:
        w = stats_mod.StatsFileWriter(tmp_path, 10.0, lambda: {"stats": {}})
        w.start()
        assert await asyncio.to_thread(in_write.wait, 5.0)
        await w.stop()
        assert not w.path.exists()
        await asyncio.sleep(0.5)  # a write that escaped stop() would have landed by now
        assert not w.path.exists()
        assert not list(tmp_path.iterdir())  # no temporary file either
        await w.write_now()  # a stopped writer writes nothing
        assert not w.path.exists() and w.writes == 0

    run_async(body())


def test_stats_files_of_dead_processes_are_marked(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = int(proc.stdout)
    import socket

    write_json_atomic(tmp_path / f"{dead}.json",
                      {"pid": dead, "host": socket.gethostname(), "stats": {"tiers": []}})  # fmt: skip
    (tmp_path / "junk.json").write_text("{not json")
    docs = {Path(d["file"]).name: d for d in read_stats_dir(tmp_path)}
    assert docs[f"{dead}.json"]["alive"] is False
    assert "error" in docs["junk.json"]
    res = cli("inspect", str(tmp_path), "--table")
    assert res.returncode == 0 and "(dead)" in res.stdout and "unreadable" in res.stdout


def test_inspect_config_scans_tiers_that_can_scan(tmp_path: Path) -> None:
    store = tmp_path / "store"
    doc = {
        "tiers": [
            {"name": "hot", "backend": "cpu"},
            {"name": "files", "backend_class": "test_hierarchy_fakes:ScannableBackend",
             "options": {"path": str(store)}},
        ]
    }  # fmt: skip
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(doc))

    async def fill() -> None:
        # the module as the subprocess will import it (PYTHONPATH=tests)
        from test_hierarchy_fakes import ScannableBackend

        b = ScannableBackend({"path": str(store)})
        await b.start()
        for i in range(3):
            await b.put(make_key(f"i{i}"), torch.zeros(1000 + i, dtype=torch.uint8))
        await b.close()

    run_async(fill())
    res = cli("inspect", "--config", str(cfg_path), "--json", "--headers")
    assert res.returncode == 0, res.stderr
    hot, files = json.loads(res.stdout)["tiers"]
    assert hot["scannable"] is False and hot["entries"] == 0
    assert files["scannable"] is True and files["entries"] == 3
    assert files["bytes"] == 1000 + 1001 + 1002 and files["namespaces"] == {"raw": 3}
    table = cli("inspect", str(cfg_path), "--table")
    assert table.returncode == 0 and "scanned" in table.stdout
    bad = cli("inspect", str(tmp_path / "nope.yaml"))
    assert bad.returncode == 1 and "does not exist" in bad.stderr
