"""The lmcache-core contract suite against the s3 backend.

Against the local S3 API server (authentication on, real HTTP): the boto3 hot path with
every mixin a persistent, shared store takes (corrupt objects, namespaces, two processes,
a writer killed mid-put), and the s3fs path; then the fsspec path over ``file://`` and
``memory://``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lmcache_backend_s3 import S3Backend
from lmcache_backend_s3.s3server import LocalS3

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

NS = Namespace(model_name="s3-contract", chunk_size=64)


class _S3Contract(BackendContract, PersistentContract, SharedContract, CorruptionContract):
    client = "boto3"

    @pytest.fixture
    def options(self, s3: LocalS3, prefix: str) -> dict[str, Any]:
        return s3.options(prefix, client=self.client)

    @pytest.fixture
    def backend_factory(self, options: dict[str, Any]) -> Callable[..., Any]:
        return lambda **opts: S3Backend({**options, **opts}, namespace=NS)

    @pytest.fixture
    def corrupt_entry(self) -> Callable[..., Any]:
        return corrupt_blob


class TestS3Boto(_S3Contract, NamespaceContract, ProcessContract):
    """boto3 in a thread pool (the hot path for s3://)."""

    @pytest.fixture
    def namespace_factory(self, options: dict[str, Any]) -> Callable[..., Any]:
        return lambda ns: S3Backend(options, namespace=ns)

    @pytest.fixture
    def backend_spec(self, options: dict[str, Any]) -> dict[str, Any]:
        return {
            "target": "lmcache_backend_s3.backend:S3Backend",
            "options": options,
            "namespace": NS.to_json(),
        }


class TestS3Fsspec(_S3Contract):
    """s3fs (through fsspec) against the same server."""

    client = "fsspec"


class TestFileUrl(BackendContract, PersistentContract, SharedContract, CorruptionContract):
    """A file:// URL (fsspec's local filesystem; atomic through a rename)."""

    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> Callable[..., Any]:
        url = f"file://{tmp_path}/tier"
        return lambda **opts: S3Backend({"url": url, **opts}, namespace=NS)

    @pytest.fixture
    def corrupt_entry(self) -> Callable[..., Any]:
        return corrupt_blob


class TestMemoryUrl(BackendContract, PersistentContract, SharedContract, CorruptionContract):
    """A memory:// URL (fsspec's in-process memory filesystem)."""

    @pytest.fixture
    def backend_factory(self) -> Callable[..., Any]:
        url = f"memory://lmcache-{uuid.uuid4().hex[:12]}"
        return lambda **opts: S3Backend({"url": url, **opts}, namespace=NS)

    @pytest.fixture
    def corrupt_entry(self) -> Callable[..., Any]:
        return corrupt_blob
