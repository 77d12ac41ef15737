"""The lmcache-core contract suite against the gds backend on its POSIX O_DIRECT path
(this machine has no CUDA driver; the path is also forced with ``force_posix`` so the
suite tests the same code where a GPU exists): one directory, and two striped ones.

Every mixin applies: persistent, shared, bounded, corruption (flips, truncations, foreign
objects on the medium), namespaces, and processes (sharing, a writer SIGKILLed mid-put).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gds_testutil import corrupt_file, object_path
from lmcache_backend_gds import GdsBackend

from lmcache_core.keys import CacheEngineKey, Namespace
from lmcache_core.testing import (
    BackendContract,
    CapacityContract,
    CorruptionContract,
    NamespaceContract,
    PersistentContract,
    ProcessContract,
    SharedContract,
)
from lmcache_core.testing.contract import make_key, random_tensor, same_bits

TARGET = "lmcache_backend_gds.backend:GdsBackend"


class _GdsContract(
    BackendContract,
    PersistentContract,
    SharedContract,
    CapacityContract,
    CorruptionContract,
    NamespaceContract,
    ProcessContract,
):
    stripes = 1

    @pytest.fixture
    def options(self, tmp_path: Path) -> dict[str, Any]:
        base: dict[str, Any] = {"max_bytes": "256MiB", "force_posix": True}
        if self.stripes == 1:
            return {**base, "path": str(tmp_path / "tier")}
        return {**base, "paths": [str(tmp_path / f"nvme{i}") for i in range(self.stripes)]}

    @pytest.fixture
    def backend_factory(self, options: dict[str, Any]) -> Callable[..., Any]:
        return lambda **opts: GdsBackend({**options, **opts})

    @pytest.fixture
    def namespace_factory(self, options: dict[str, Any]) -> Callable[[Namespace], Any]:
        return lambda ns: GdsBackend(options, namespace=ns)

    @pytest.fixture
    def backend_spec(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"target": TARGET, "options": options}

    @pytest.fixture
    def corrupt_entry(self) -> Callable[..., Any]:
        def corrupt(backend: GdsBackend, key: CacheEngineKey, kind: str) -> None:
            corrupt_file(object_path(backend, key), kind, key)

        return corrupt


class TestGdsContract(_GdsContract):
    """One directory: the disk tier's layout."""


class TestGdsStripedContract(_GdsContract):
    """Two directories striped by key.

    Each directory is bounded by max_bytes / 2 and has its own LRU order, so the
    contract's LRU test (1 MiB for 256 KiB chunks: one 516 KiB stripe holds a single
    such object) is run with the whole bound per stripe; the bound test keeps the
    contract's numbers."""

    stripes = 2

    def test_recently_used_entries_survive_eviction(
        self, backend_factory: Callable[..., Any]
    ) -> None:
        super().test_recently_used_entries_survive_eviction(
            lambda **opts: backend_factory(
                **{**opts, "max_bytes": opts.get("max_bytes", 1 << 20) * self.stripes}
            )
        )

    def test_keys_are_spread_over_the_directories(self, options: dict[str, Any]) -> None:
        async def body() -> None:
            b = GdsBackend(options)
            await b.start()
            try:
                keys = [make_key(f"spread{i}") for i in range(64)]
                vals = [random_tensor((1024,), seed=i) for i in range(64)]
                assert await b.batched_put(keys, vals) == [True] * 64
                per = [(await s.usage())["entries"] for s in b.stripes]
                assert sum(per) == 64 and min(per) >= 16, per
                got = await b.batched_get(keys)
                assert all(same_bits(g, v) for g, v in zip(got, vals, strict=True))
            finally:
                await b.close()

        self.run(body)
