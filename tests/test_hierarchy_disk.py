"""The hierarchy over a real disk tier (lmcache-backend-disk, when installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lmcache_core import TieredHierarchy, load_config
from lmcache_core.testing import (
    BackendContract,
    PersistentContract,
    make_key,
    random_tensor,
    run_async,
    same_bits,
)

pytest.importorskip("lmcache_backend_disk", reason="lmcache-backend-disk is not installed")


def cpu_over_disk(root: Path, **extra: Any) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "hot", "backend": "cpu", "options": {"max_bytes": "64MiB"}},
            {"name": "disk", "backend": "disk",
             "options": {"path": str(root), "max_bytes": "512MiB"}, **extra},
        ]
    }  # fmt: skip


class TestCpuOverDiskHierarchy(BackendContract, PersistentContract):
    """Write-through to disk: close drains, so the hierarchy persists across reopen."""

    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> Callable[..., Any]:
        return lambda **opts: TieredHierarchy.from_config(cpu_over_disk(tmp_path / "kv"))


def test_file_url_fills_the_disk_path(tmp_path: Path) -> None:
    cfg = load_config({"tiers": [{"backend": f"file://{tmp_path}/kv"}]})
    assert cfg.tiers[0].backend == "disk" and cfg.tiers[0].options.path == f"{tmp_path}/kv"


def test_a_new_hierarchy_finds_and_promotes_what_an_old_one_stored(tmp_path: Path) -> None:
    keys = [make_key(f"d{i}") for i in range(4)]
    vals = [random_tensor((64 * 1024,), torch.bfloat16, seed=i) for i in range(4)]

    async def first() -> None:
        async with TieredHierarchy.from_config(cpu_over_disk(tmp_path / "kv")) as h:
            assert await h.batched_put(keys, vals) == [True] * 4

    async def second() -> None:
        async with TieredHierarchy.from_config(cpu_over_disk(tmp_path / "kv")) as h:
            res = await h.lookup_prefix(keys, lease_s=10)
            assert res.num_hit == 4 and res.counts() == {"hot": 0, "disk": 4}
            assert res.leased == 4  # the disk tier pins (across processes)
            outs = [torch.empty_like(v) for v in vals]
            assert await h.batched_get_into(keys, outs) == [True] * 4
            assert all(same_bits(o, v) for o, v in zip(outs, vals, strict=True))
            await h.flush()
            assert (await h.lookup_prefix(keys)).counts() == {"hot": 4, "disk": 0}
            assert h.tier("hot").stats.promotions == 4

    run_async(first())
    run_async(second())


def test_inspect_reports_what_the_disk_tier_stores(tmp_path: Path) -> None:
    doc = cpu_over_disk(tmp_path / "kv")

    async def fill() -> None:
        async with TieredHierarchy.from_config(doc) as h:
            for i in range(3):
                await h.put(make_key(f"in{i}"), random_tensor((4096,), torch.uint8, seed=i))

    run_async(fill())
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    exe = Path(sys.executable).with_name("lmcache-core")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "lmcache_core.cli"]
    res = subprocess.run([*cmd, "inspect", str(cfg), "--json"], capture_output=True, text=True,
                         env=dict(os.environ), timeout=120, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr
    hot, disk = json.loads(res.stdout)["tiers"]
    assert hot["entries"] == 0 and disk["scannable"] is True and disk["entries"] == 3
