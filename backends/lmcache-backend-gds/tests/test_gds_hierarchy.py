"""A gds tier configured by name under the cpu tier: the hierarchy's contract, leases
(pins through the gds backend, striped too) and persistence across hierarchies."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_core import TieredHierarchy
from lmcache_core.testing import (
    BackendContract,
    PersistentContract,
    make_key,
    random_tensor,
    run_async,
    same_bits,
)


def cpu_over_gds(root: Path, stripes: int = 1) -> dict[str, Any]:
    where: dict[str, Any] = (
        {"path": str(root)}
        if stripes == 1
        else {"paths": [str(root / f"nvme{i}") for i in range(stripes)]}
    )
    return {
        "tiers": [
            {"name": "hot", "backend": "cpu", "options": {"max_bytes": "64MiB"}},
            {"name": "nvme", "backend": "gds", "options": {**where, "max_bytes": "512MiB"}},
        ]
    }


class TestCpuOverGdsHierarchy(BackendContract, PersistentContract):
    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> Callable[..., Any]:
        return lambda **opts: TieredHierarchy.from_config(cpu_over_gds(tmp_path / "kv"))


@pytest.mark.parametrize("stripes", [1, 2])
def test_a_new_hierarchy_finds_what_an_old_one_stored_with_leases(
    tmp_path: Path, stripes: int
) -> None:
    keys = [make_key(f"h{i}") for i in range(6)]
    vals = [random_tensor((64 * 1024,), torch.bfloat16, seed=i) for i in range(6)]

    async def first() -> None:
        async with TieredHierarchy.from_config(cpu_over_gds(tmp_path / "kv", stripes)) as h:
            assert await h.batched_put(keys, vals) == [True] * 6

    async def second() -> None:
        async with TieredHierarchy.from_config(cpu_over_gds(tmp_path / "kv", stripes)) as h:
            gds = h.tiers[1].backend
            assert h.tiers[1].can_pin
            found = await h.lookup_prefix(keys, lease_s=30.0)
            assert found.num_hit == 6 and found.tier_of(0) == "nvme"
            assert all(found.pinned), found  # leased in the gds tier, every stripe
            assert sum(s.counters.pins for s in gds.stripes) == 6
            assert await h.release(keys) == 6
            got = await h.batched_get(keys)
            assert all(same_bits(g, v) for g, v in zip(got, vals, strict=True))

    run_async(first())
    run_async(second())
