"""The backend contract suite against two-tier hierarchies (write-through and write-back)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from lmcache_core import TieredHierarchy
from lmcache_core.testing import BackendContract


class TestTwoTierWriteThrough(BackendContract):
    @pytest.fixture
    def backend_factory(self) -> Callable[..., Any]:
        def make(**opts: Any) -> TieredHierarchy:
            return TieredHierarchy.from_config(
                {
                    "tiers": [
                        {"name": "hot", "backend": "cpu", "options": {"max_bytes": "256MiB"}},
                        {"name": "warm", "backend": "cpu", "options": {"max_bytes": "512MiB"}},
                    ]
                }
            )

        return make


class TestTwoTierWriteBack(BackendContract):
    """A small top tier, so the suite's larger tests evict into the write-back tier."""

    @pytest.fixture
    def backend_factory(self) -> Callable[..., Any]:
        def make(**opts: Any) -> TieredHierarchy:
            return TieredHierarchy.from_config(
                {
                    "tiers": [
                        {"name": "hot", "backend": "cpu", "options": {"max_bytes": "24MiB"}},
                        {
                            "name": "warm",
                            "backend": "cpu",
                            "options": {"max_bytes": "512MiB"},
                            "write": {"policy": "back"},
                        },
                    ]
                }
            )

        return make
