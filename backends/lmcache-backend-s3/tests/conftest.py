"""Fixtures of the s3 backend's tests: one local S3 API server (moto's server mode, in its
own process, authentication on) for the whole session, and a fresh prefix per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from lmcache_backend_s3.s3server import LocalS3, start_local_s3


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LocalS3]:
    server = start_local_s3("lmcache-test")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server: LocalS3) -> LocalS3:
    """The server, resumed if a test left it paused."""
    s3_server.resume()
    return s3_server


@pytest.fixture
def prefix() -> str:
    """A prefix no other test uses (the bucket is shared by the session)."""
    return f"t-{uuid.uuid4().hex[:12]}"
