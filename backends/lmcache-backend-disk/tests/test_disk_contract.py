"""The lmcache-core contract suite against the disk backend (persistent, shared, bounded).

Three configurations: a directory on the local filesystem with O_DIRECT (when accepted),
the same with buffered I/O, and a directory under /dev/shm (the same-host DRAM tier).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from lmcache_backend_disk import DiskBackend

from lmcache_core.testing import (
    BackendContract,
    CapacityContract,
    PersistentContract,
    SharedContract,
)


class _DiskContract(BackendContract, PersistentContract, SharedContract, CapacityContract):
    extra: dict[str, Any] = {}

    @pytest.fixture
    def tier_dir(self, tmp_path: Path) -> Iterator[str]:
        yield str(tmp_path / "tier")

    @pytest.fixture
    def backend_factory(self, tier_dir: str) -> Callable[..., Any]:
        def make(**opts: Any) -> DiskBackend:
            return DiskBackend({"path": tier_dir, "max_bytes": "256MiB", **self.extra, **opts})

        return make


class TestDiskContract(_DiskContract):
    """Local filesystem, O_DIRECT when the filesystem accepts it."""


class TestDiskContractBuffered(_DiskContract):
    """Local filesystem, buffered I/O."""

    extra = {"direct_io": "false"}


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")
class TestDiskContractDevShm(_DiskContract):
    """A tier under /dev/shm: the same-host DRAM tier."""

    @pytest.fixture
    def tier_dir(self, tmp_path: Path) -> Iterator[str]:
        path = f"/dev/shm/lmcache-disk-test-{uuid.uuid4().hex[:12]}"
        yield path
        shutil.rmtree(path, ignore_errors=True)
