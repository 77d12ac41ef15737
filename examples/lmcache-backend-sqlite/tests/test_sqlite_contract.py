"""The lmcache-core contract suite against the sqlite backend, every mixin it declares."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lmcache_backend_sqlite.backend import SQLiteBackend

from lmcache_core.keys import Namespace
from lmcache_core.testing import (
    BackendContract,
    CorruptionContract,
    NamespaceContract,
    PersistentContract,
    ProcessContract,
    SharedContract,
)
from lmcache_core.testing.blob import corrupt_blob

NS = Namespace(model_name="sqlite-contract", chunk_size=64)


class TestSQLiteBackend(
    BackendContract,
    PersistentContract,
    SharedContract,
    CorruptionContract,
    NamespaceContract,
    ProcessContract,
):
    @pytest.fixture
    def options(self, tmp_path: Path) -> dict[str, Any]:
        return {"path": str(tmp_path / "kv.db")}

    @pytest.fixture
    def backend_factory(self, options: dict[str, Any]) -> Callable[..., Any]:
        return lambda **opts: SQLiteBackend({**options, **opts}, namespace=NS)

    @pytest.fixture
    def corrupt_entry(self) -> Callable[..., Any]:
        return corrupt_blob

    @pytest.fixture
    def namespace_factory(self, options: dict[str, Any]) -> Callable[..., Any]:
        return lambda ns: SQLiteBackend(options, namespace=ns)

    @pytest.fixture
    def backend_spec(self, options: dict[str, Any]) -> dict[str, Any]:
        return {
            "target": "lmcache_backend_sqlite.backend:SQLiteBackend",
            "options": options,
            "namespace": NS.to_json(),
        }
