"""The S3 hot path: boto3 in the backend's thread pool (measured faster than s3fs's async
API against the same server with the same botocore settings; see docs/backends/s3.md).

Every call is a plain blocking boto3 call; :class:`~lmcache_core.blob.BlobBackend` runs
them on its ``max_concurrency`` I/O threads. One botocore client is shared by the threads
(botocore clients are thread-safe) with a connection pool of the same size.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache_core import format as fmt
from lmcache_core.blob import ObjectStat

from .options import S3Options, split_s3_url

__all__ = ["BotoStore", "botocore_config", "error_code"]

#: Object metadata holding the core-format checksum (compared on a conditional-put conflict).
CHECKSUM_META = "lmc-checksum"


def botocore_config(opts: S3Options | None = None, **override: Any) -> Any:
    """The botocore ``Config`` of the backend (the benchmark's raw boto3 baseline uses it
    too). Checksums of requests and responses only where S3 requires them: every object
    carries its own end-to-end xxh3-128 checksum, checked on every read."""
    from botocore.config import Config

    o = opts
    kwargs: dict[str, Any] = {
        "connect_timeout": o.connect_timeout_s if o else 2.0,
        "read_timeout": o.read_timeout_s if o else 10.0,
        "retries": {"max_attempts": 1 + (o.retries if o else 2), "mode": "standard"},
        "max_pool_connections": o.max_concurrency if o else 16,
        "s3": {"addressing_style": o.addressing_style if o else "auto"},
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
        "tcp_keepalive": True,
    }
    kwargs.update(override)
    return Config(**kwargs)


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore ``ClientError`` (``"404"``, ``"NoSuchKey"``...)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def _status(exc: BaseException) -> int:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return 0
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


class BotoStore:
    """Byte operations on ``s3://bucket/prefix`` through one boto3 client."""

    def __init__(self, opts: S3Options) -> None:
        self.opts = opts
        self.bucket, self.prefix = split_s3_url(opts.url)
        self.client: Any = None
        self.conditional = opts.conditional_put
        self._parts: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.requests = {"get": 0, "put": 0, "head": 0, "delete": 0, "list": 0, "multipart": 0}
        self.conditional_conflicts = 0
        extra: dict[str, str] = {}
        if opts.server_side_encryption:
            extra["ServerSideEncryption"] = opts.server_side_encryption
        if opts.sse_kms_key_id:
            extra["SSEKMSKeyId"] = opts.sse_kms_key_id
        self._sse = extra

    # ------------------------------------------------------------------ life cycle
    def open(self) -> None:
        """Make the client and check the bucket (raises with a clear message)."""
        import boto3
        from botocore.exceptions import ClientError

        session = boto3.session.Session(
            aws_access_key_id=self.opts.access_key_id,
            aws_secret_access_key=self.opts.secret_access_key,
            aws_session_token=self.opts.session_token,
            region_name=self.opts.region,
        )
        self.client = session.client(
            "s3",
            endpoint_url=self.opts.endpoint_url,
            config=botocore_config(self.opts),
            verify=self.opts.tls_verify,
        )
        # botocore asks for "Expect: 100-continue" on every file-like body: one more round
        # trip per put before the body goes (raw puts of bytes do not wait for it)
        self.client.meta.events.register_last("before-call.s3", _no_expect_continue)
        try:  # a one-key listing: checks the bucket, the credentials and s3:ListBucket
            self._count("list")
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
        except ClientError as exc:
            raise RuntimeError(self._explain_bucket_error(exc)) from None
        except Exception as exc:
            raise RuntimeError(_explain_transport_error(exc, self.opts)) from None

    def _explain_bucket_error(self, exc: BaseException) -> str:
        status, code = _status(exc), error_code(exc)
        if status == 404 or code in ("404", "NoSuchBucket", "NotFound"):
            return f"bucket {self.bucket!r} does not exist (ListObjectsV2: {code or status})"
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"):
            return f"the credentials are not accepted ({code}): check the access key and secret"
        if status in (401, 403) or code in ("403", "AccessDenied"):
            return (
                f"access denied to bucket {self.bucket!r} ({code or status}): the credentials' "
                "policy must allow s3:ListBucket, s3:GetObject, s3:PutObject, s3:DeleteObject"
            )
        if status == 301 or code in ("301", "PermanentRedirect"):
            return f"bucket {self.bucket!r} is in another region: set the region option"
        return f"listing bucket {self.bucket!r} failed: {code or status}: {exc}"

    def close(self) -> None:
        if self._parts is not None:
            self._parts.shutdown(wait=False, cancel_futures=True)
            self._parts = None
        if self.client is not None:
            self.client.close()
            self.client = None

    def _count(self, what: str) -> None:
        with self._lock:
            self.requests[what] += 1

    def _key(self, name: str) -> str:
        return self.prefix + name

    # ------------------------------------------------------------------ reads
    def read_object(self, name: str) -> bytes | None:
        from botocore.exceptions import ClientError

        self._count("get")
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as exc:
            if error_code(exc) in ("NoSuchKey", "404"):
                return None
            raise
        body = resp["Body"]
        try:
            data: bytes = body.read()
        finally:
            body.close()
        return data

    def read_range(self, name: str, start: int, length: int) -> bytes | None:
        from botocore.exceptions import ClientError

        if length <= 0:
            return b""
        self._count("get")
        try:
            resp = self.client.get_object(
                Bucket=self.bucket,
                Key=self._key(name),
                Range=f"bytes={start}-{start + length - 1}",
            )
        except ClientError as exc:
            code = error_code(exc)
            if code in ("NoSuchKey", "404"):
                return None
            if code == "InvalidRange":
                return b""
            raise
        body = resp["Body"]
        try:
            data: bytes = body.read()
        finally:
            body.close()
        return data

    def stat_object(self, name: str) -> ObjectStat | None:
        from botocore.exceptions import ClientError

        self._count("head")
        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError as exc:
            if _status(exc) == 404 or error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return ObjectStat(name, int(resp["ContentLength"]), resp["LastModified"].timestamp())

    def list_objects(self, prefix: str) -> Iterator[ObjectStat]:
        token: str | None = None
        cut = len(self.prefix)
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + prefix}
            if token:
                kwargs["ContinuationToken"] = token
            self._count("list")
            resp = self.client.list_objects_v2(**kwargs)
            for item in resp.get("Contents", ()):
                yield ObjectStat(
                    item["Key"][cut:], int(item["Size"]), item["LastModified"].timestamp()
                )
            if not resp.get("IsTruncated"):
                return
            token = resp.get("NextContinuationToken")

    # ------------------------------------------------------------------ writes
    def write_object(self, name: str, data: memoryview) -> None:
        from botocore.exceptions import ClientError

        digest = _checksum_of(data)
        meta = {CHECKSUM_META: digest} if digest else {}
        conditional = self.conditional and bool(digest)
        try:
            self._put(name, data, meta, conditional)
            return
        except ClientError as exc:
            status, code = _status(exc), error_code(exc)
            if status == 412 or code == "PreconditionFailed":
                self.conditional_conflicts += 1
                if self._same_object(name, digest):
                    return  # another writer stored the same chunk: nothing to do
            elif status == 501 or code == "NotImplemented":
                self.conditional = False  # the server does not do conditional writes
            else:
                raise
        self._put(name, data, meta, False)  # a real overwrite (the contract's semantics)

    def _same_object(self, name: str, digest: str) -> bool:
        from botocore.exceptions import ClientError

        self._count("head")
        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except ClientError:
            return False
        return bool(resp.get("Metadata", {}).get(CHECKSUM_META) == digest)

    def _put(self, name: str, data: memoryview, meta: dict[str, str], conditional: bool) -> None:
        cond = {"IfNoneMatch": "*"} if conditional else {}
        if len(data) >= self.opts.multipart_threshold:
            self._multipart(name, data, meta, cond)
            return
        self._count("put")
        self.client.put_object(
            Bucket=self.bucket,
            Key=self._key(name),
            Body=_Body(data),
            Metadata=meta,
            **self._sse,
            **cond,
        )

    def _multipart(
        self, name: str, data: memoryview, meta: dict[str, str], cond: dict[str, str]
    ) -> None:
        key = self._key(name)
        self._count("multipart")
        upload = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=key, Metadata=meta, **self._sse
        )["UploadId"]
        size = self.opts.multipart_part_size
        bounds = [(i, min(i + size, len(data))) for i in range(0, len(data), size)]
        try:
            with self._lock:
                if self._parts is None:
                    self._parts = ThreadPoolExecutor(
                        self.opts.max_concurrency, thread_name_prefix="lmcache-s3-parts"
                    )
                pool = self._parts

            def part(n: int, lo: int, hi: int) -> dict[str, Any]:
                self._count("multipart")
                resp = self.client.upload_part(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload,
                    PartNumber=n,
                    Body=_Body(data[lo:hi]),
                )
                return {"PartNumber": n, "ETag": resp["ETag"]}

            futures = [pool.submit(part, n + 1, lo, hi) for n, (lo, hi) in enumerate(bounds)]
            parts = [f.result() for f in futures]
            self._count("multipart")
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=key,
                UploadId=upload,
                MultipartUpload={"Parts": parts},
                **cond,
            )
        except BaseException:
            try:
                self._count("multipart")
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            except Exception:
                pass  # a lifecycle rule removes abandoned uploads (docs/backends/s3.md)
            raise

    def delete_object(self, name: str) -> bool:
        if self.stat_object(name) is None:
            return False
        self._count("delete")
        self.client.delete_object(Bucket=self.bucket, Key=self._key(name))
        return True


def _no_expect_continue(params: dict[str, Any], **kwargs: Any) -> None:
    params.get("headers", {}).pop("Expect", None)


class _Body:
    """A read-only file over a memoryview, for botocore bodies without a copy.

    botocore takes bytes, bytearray or a file; ``read`` hands out views of the object
    itself in large slices (http.client sends each with one ``sendall``), and
    ``seek``/``tell`` let botocore measure the body and rewind it for a retry."""

    #: Bytes per ``read`` whatever size is asked: few, large sends.
    SLICE = 64 << 20

    def __init__(self, view: memoryview) -> None:
        self._view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self._pos = 0

    def read(self, size: int = -1) -> memoryview:
        end = len(self._view) if size is None or size < 0 else self._pos + max(size, self.SLICE)
        out = self._view[self._pos : end]
        self._pos += len(out)
        return out

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, len(self._view))[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)


def _checksum_of(data: memoryview) -> str:
    """The core-format checksum in ``data``'s header ("" for other objects)."""
    try:
        return fmt.decode_header(data[: fmt.MAX_HEADER_BYTES]).checksum
    except Exception:
        return ""


def _explain_transport_error(exc: BaseException, opts: S3Options) -> str:
    from botocore.exceptions import (
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    where = opts.endpoint_url or "the AWS endpoint"
    if isinstance(exc, NoCredentialsError):
        return (
            "no credentials: set access_key_id/secret_access_key (as {$env: NAME}) or "
            "configure the default AWS chain (AWS_ACCESS_KEY_ID, ~/.aws, an instance role)"
        )
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError)):
        return f"cannot reach {where}: {type(exc).__name__}"
    if isinstance(exc, ReadTimeoutError):
        return f"{where} did not answer within read_timeout_s={opts.read_timeout_s}"
    return f"{type(exc).__name__}: {exc}"
