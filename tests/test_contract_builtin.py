"""The contract suite against the built-in backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lmcache_core import CPUBackend
from lmcache_core.testing import BackendContract, CapacityContract, ReferenceBackend


class TestReferenceBackend(BackendContract):
    @pytest.fixture
    def backend_factory(self) -> Callable[..., Any]:
        return lambda **opts: ReferenceBackend(opts)


class TestCPUBackend(BackendContract, CapacityContract):
    @pytest.fixture
    def backend_factory(self) -> Callable[..., Any]:
        def make(**opts: Any) -> CPUBackend:
            return CPUBackend({"max_bytes": "256MiB", **opts})

        return make
