"""The contract suite against the built-in backends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host memory")
class TestCPUBackendPinned(BackendContract, CapacityContract):  # pragma: no cover - GPU only
    """The cpu tier with pinned host buffers (tools/gpu_check.sh runs it on a GPU machine)."""

    @pytest.fixture
    def backend_factory(self) -> Callable[..., Any]:
        def make(**opts: Any) -> CPUBackend:
            return CPUBackend({"max_bytes": "256MiB", "pin_memory": "true", **opts})

        return make
