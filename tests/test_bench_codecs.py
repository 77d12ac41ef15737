"""``lmcache-core bench codecs`` on a KV file (the engine capture is exercised by hand and
in docs/codecs.md's run: it starts vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmcache_core.cli.bench_codecs import load_kv_file, read_tier_chunks, save_kv_file
from lmcache_core.cli.main import main
from lmcache_core.testing.codecs import kv_like


@pytest.fixture
def kv_file(tmp_path: Path) -> Path:
    path = tmp_path / "kv.safetensors"
    save_kv_file(path, [kv_like((2, 2, 2, 32, 64), torch.float32, seed=s) for s in range(3)])
    return path


def test_kv_file_round_trip(kv_file: Path) -> None:
    chunks = load_kv_file(kv_file)
    assert len(chunks) == 3 and torch.equal(chunks[1], kv_like((2, 2, 2, 32, 64), seed=1))


def test_bench_codecs_json(kv_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "codecs", "--kv", str(kv_file), "--rounds", "2", "--json"]
    assert main([*argv, "--codec", "lossless", "--codec", 'int8:{"group_size":64}']) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["quality"] == []  # no --model: no engine
    rows = {r["codec"].split()[0]: r for r in doc["codecs"]}
    assert rows["lossless"]["max_abs_error"] == 0 and rows["lossless"]["lossless"]
    assert rows["int8"]["codec"] == 'int8 {"group_size":64}'
    assert 0 < rows["int8"]["max_abs_error"] < 0.2 and rows["int8"]["ratio"] > 3
    for r in rows.values():
        assert r["chunks"] == 3 and r["raw_bytes_per_chunk"] == 2 * 2 * 2 * 32 * 64 * 4
        assert r["encode_gbps"] > 0 and r["decode_gbps"] > 0 and r["copy_aa_spread"] >= 1
        assert r["bytes_per_chunk"] * r["ratio"] == pytest.approx(r["raw_bytes_per_chunk"])


def test_bench_codecs_table(kv_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codecs", "--kv", str(kv_file), "--rounds", "1", "--codec", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "3 chunks from" in out and "a plain memory copy" in out
    assert '| `fp8 {"group_size":32}` |' in out


def test_bench_codecs_needs_a_source(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "codecs"])
    assert exc.value.code == 2
    assert "--kv" in capsys.readouterr().err


def test_read_tier_chunks_reads_a_disk_tier(tmp_path: Path) -> None:
    import asyncio

    from lmcache_core import TieredHierarchy
    from lmcache_core.keys import CacheEngineKey

    x = kv_like((2, 2, 2, 32, 64))

    async def store() -> None:
        h = TieredHierarchy.from_config(
            {"namespace": "t", "tiers": [{"backend": "disk", "options": {"path": str(tmp_path)}}]}
        )
        await h.start()
        await h.put(CacheEngineKey("m", 1, 0, 5, "float32"), x)
        await h.close()

    asyncio.run(store())
    (chunk,) = read_tier_chunks(tmp_path)
    assert torch.equal(chunk, x)


def test_bench_codecs_sizes_only(kv_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codecs", "--kv", str(kv_file), "--sizes-only", "--codec", "int4"]) == 0
    out = capsys.readouterr().out
    assert "no timing" in out and '| `int4 {"group_size":32}` |' in out and "| - | - | - |" in out
