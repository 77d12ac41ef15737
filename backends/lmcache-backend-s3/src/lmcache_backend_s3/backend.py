"""The ``s3`` backend: a shared, unbounded remote tier on :class:`~lmcache_core.blob.BlobBackend`.

The byte operations go to :class:`~lmcache_backend_s3.store_boto.BotoStore` (``s3://``,
the hot path) or :class:`~lmcache_backend_s3.store_fsspec.FsspecStore` (any fsspec URL);
the base class adds the object format and its verification, the threads, batching, prefix
lookups with an existence cache, and the maintenance interface (``lmcache-core gc``).

Unbounded by design: every host writes to one bucket, so no instance can bound it; the
bucket is bounded by ``lmcache-core gc`` runs and lifecycle rules (docs/backends/s3.md).
"""

from __future__ import annotations

from typing import Any

from lmcache_core.backend import Capabilities
from lmcache_core.blob import BlobBackend, ObjectStat
from lmcache_core.config import REDACTED, redact_url
from lmcache_core.config.options import build_options
from lmcache_core.keys import Namespace

from .options import S3Options
from .store_boto import BotoStore
from .store_fsspec import FsspecStore

__all__ = ["S3Backend"]


class S3Backend(BlobBackend):
    """KV chunks as objects in an S3 bucket (or under any fsspec URL)."""

    Options = S3Options
    capabilities = Capabilities(persistent=True, shared=True, bounded=False)
    interface_version = "1.0"  # the lmcache_core.interface version it implements
    #: boto3 has sent the body when put_object returns; fsspec's local and memory
    #: filesystems copy it (``bytes(data)``) or write it out: nothing keeps ``data``.
    keeps_written_data = False

    def __init__(
        self, options: Any = None, *, namespace: Namespace | None = None, name: str | None = None
    ) -> None:
        opts = build_options(S3Options, options)
        super().__init__(opts, namespace=namespace, name=name or "s3")
        self.opts = opts
        use_boto = opts.client == "boto3" or (
            opts.client == "auto" and opts.url.startswith("s3://")
        )
        if opts.client == "boto3" and not opts.url.startswith("s3://"):
            from lmcache_core.errors import ConfigError

            raise ConfigError("client boto3 needs an s3:// url", "options.client")
        self.store: BotoStore | FsspecStore = BotoStore(opts) if use_boto else FsspecStore(opts)

    def __repr__(self) -> str:
        return (
            f"S3Backend(name={self.name!r}, url={self.describe_store()!r}, state={self._state!r})"
        )

    # ------------------------------------------------------------------ byte operations
    def describe_store(self) -> str:
        where = redact_url(self.opts.url)
        if self.opts.endpoint_url:
            where += f" at {redact_url(self.opts.endpoint_url)}"
        return where

    def open_store(self) -> None:
        try:
            self.store.open()
        except Exception as exc:
            raise RuntimeError(self._scrub(str(exc))) from None

    def close_store(self) -> None:
        self.store.close()

    def read_object(self, name: str) -> bytes | None:
        return self.store.read_object(name)

    def read_range(self, name: str, start: int, length: int) -> bytes | None:
        return self.store.read_range(name, start, length)

    def write_object(self, name: str, data: memoryview) -> None:
        self.store.write_object(name, data)

    def delete_object(self, name: str) -> bool:
        return self.store.delete_object(name)

    def stat_object(self, name: str) -> ObjectStat | None:
        return self.store.stat_object(name)

    def list_objects(self, prefix: str) -> list[ObjectStat]:
        return list(self.store.list_objects(prefix))

    # ------------------------------------------------------------------ statistics
    def _usage(self) -> dict[str, Any]:
        return {
            "client": type(self.store).__name__,
            "requests": dict(self.store.requests),
            "conditional_conflicts": self.store.conditional_conflicts,
            "unbounded": True,
        }

    def _scrub(self, text: str) -> str:
        for secret in self.opts.secrets():
            text = text.replace(secret, REDACTED)
        return text
