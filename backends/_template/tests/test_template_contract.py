"""The lmcache-core contract suite against the ``template`` backend, and its hook."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lmcache_backend_template import plugin
from lmcache_backend_template.backend import TemplateBackend

from lmcache_core.keys import Namespace
from lmcache_core.plugins import BackendRegistry
from lmcache_core.testing import (
    BackendContract,
    CorruptionContract,
    NamespaceContract,
    PersistentContract,
    SharedContract,
)
from lmcache_core.testing.blob import corrupt_blob

NS = Namespace(model_name="template-contract", chunk_size=64)


class TestTemplateBackend(
    BackendContract, PersistentContract, SharedContract, CorruptionContract, NamespaceContract
):
    @pytest.fixture
    def options(self, tmp_path: Path) -> dict[str, Any]:
        return {"path": str(tmp_path)}

    @pytest.fixture
    def backend_factory(self, options: dict[str, Any]) -> Callable[..., Any]:
        return lambda **opts: TemplateBackend({**options, **opts}, namespace=NS)

    @pytest.fixture
    def corrupt_entry(self) -> Callable[..., Any]:
        return corrupt_blob

    @pytest.fixture
    def namespace_factory(self, options: dict[str, Any]) -> Callable[..., Any]:
        return lambda ns: TemplateBackend(options, namespace=ns)


def test_the_hook_registers_the_backend() -> None:
    registry = BackendRegistry()
    plugin.lmcache_register_backends(registry=registry)
    spec = registry.get("template")
    assert spec.load() is TemplateBackend
    assert {o["name"] for o in spec.describe_options()} == {"path", "max_concurrency"}
