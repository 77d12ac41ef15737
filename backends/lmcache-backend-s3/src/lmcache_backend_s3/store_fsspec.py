"""Byte operations on any fsspec URL (``s3://`` through s3fs, ``file://``, ``memory://``,
and every other filesystem fsspec knows).

Calls are fsspec's synchronous API, run on the backend's I/O threads. Writes are atomic:
object stores publish a PUT whole; on a local filesystem the bytes go to a temporary file
in the same directory, then a rename; the memory filesystem stores one value at once.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from lmcache_core.blob import ObjectStat

from .options import S3Options

__all__ = ["FsspecStore"]

_TMP = ".tmp-"


def _mtime(info: dict[str, Any]) -> float:
    for field in ("LastModified", "mtime", "created", "last_modified"):
        value = info.get(field)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


class FsspecStore:
    """Byte operations under the root of an fsspec URL."""

    def __init__(self, opts: S3Options) -> None:
        self.opts = opts
        self.fs: Any = None
        self.root = ""
        self.local = False
        self.requests = {"get": 0, "put": 0, "head": 0, "delete": 0, "list": 0, "multipart": 0}
        self.conditional_conflicts = 0

    def storage_options(self) -> dict[str, Any]:
        """fsspec options for the URL's protocol (S3 settings for s3://)."""
        o = self.opts
        if not o.url.startswith(("s3://", "s3a://")):
            return {}
        from .store_boto import botocore_config

        so: dict[str, Any] = {
            "client_kwargs": {"region_name": o.region, "verify": o.tls_verify},
            "config_kwargs": {
                k: v
                for k, v in vars(botocore_config(o)).items()
                if k
                in (
                    "connect_timeout",
                    "read_timeout",
                    "retries",
                    "max_pool_connections",
                    "s3",
                    "request_checksum_calculation",
                    "response_checksum_validation",
                )
            },
            "max_concurrency": o.max_concurrency,
            "use_listings_cache": False,
        }
        if o.endpoint_url:
            so["endpoint_url"] = o.endpoint_url
        if o.access_key_id:
            so["key"] = o.access_key_id
            so["secret"] = o.secret_access_key
        if o.session_token:
            so["token"] = o.session_token
        extra: dict[str, str] = {}
        if o.server_side_encryption:
            extra["ServerSideEncryption"] = o.server_side_encryption
        if o.sse_kms_key_id:
            extra["SSEKMSKeyId"] = o.sse_kms_key_id
        if extra:
            so["s3_additional_kwargs"] = extra
        return so

    def open(self) -> None:
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.opts.url, **self.storage_options())
        fs.invalidate_cache()
        self.fs, self.root = fs, root.rstrip("/")
        protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        self.local = "file" in protocols or "local" in protocols
        if self.local:
            os.makedirs(self.root, exist_ok=True)
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise PermissionError(f"directory {self.root} is not writable")
        elif not self.root:
            raise ValueError(f"{self.opts.url!r} names no bucket or directory")
        else:
            self.requests["list"] += 1
            try:
                fs.ls(self.root.split("/", 1)[0] if "s3" in protocols else self.root)
            except FileNotFoundError:
                if "s3" in protocols:
                    raise FileNotFoundError(
                        f"bucket {self.root.split('/', 1)[0]!r} does not exist"
                    ) from None
                fs.makedirs(self.root, exist_ok=True)

    def close(self) -> None:
        self.fs = None

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def read_object(self, name: str) -> bytes | None:
        self.requests["get"] += 1
        try:
            data: bytes = self.fs.cat_file(self._path(name))
        except FileNotFoundError:
            return None
        return data

    def read_range(self, name: str, start: int, length: int) -> bytes | None:
        self.requests["get"] += 1
        try:
            data: bytes = self.fs.cat_file(self._path(name), start=start, end=start + length)
        except FileNotFoundError:
            return None
        return data

    def write_object(self, name: str, data: memoryview) -> None:
        path = self._path(name)
        self.requests["put"] += 1
        if self.local:
            directory = os.path.dirname(path)
            os.makedirs(directory, exist_ok=True)
            tmp = os.path.join(directory, f"{_TMP}{uuid.uuid4().hex}")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                raise
            return
        self.fs.pipe_file(path, bytes(data))

    def stat_object(self, name: str) -> ObjectStat | None:
        self.requests["head"] += 1
        try:
            info = self.fs.info(self._path(name))
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return ObjectStat(name, int(info.get("size") or 0), _mtime(info))

    def list_objects(self, prefix: str) -> Iterator[ObjectStat]:
        self.requests["list"] += 1
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return
        cut = len(self.root) + 1
        for path, info in found.items():
            name = path[cut:] if path.startswith(self.root + "/") else path.lstrip("/")[cut - 1 :]
            if name.startswith(prefix) and info.get("type") != "directory":
                yield ObjectStat(name, int(info.get("size") or 0), _mtime(info))

    def delete_object(self, name: str) -> bool:
        path = self._path(name)
        if self.stat_object(name) is None:
            return False
        self.requests["delete"] += 1
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            return False
        return True
