"""Options of the ``s3`` backend (validated by :func:`lmcache_core.config.options.build_options`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from urllib.parse import urlsplit

from lmcache_core.config import REDACTED
from lmcache_core.config.options import option
from lmcache_core.errors import ConfigError

__all__ = ["S3Options", "split_s3_url"]

MiB = 1 << 20


@dataclass(frozen=True)
class S3Options:
    """Options of the ``s3`` backend. Secrets (kind ``secret``) never appear in its repr."""

    url: str = option(
        kind="str",
        doc="Where the objects go: s3://bucket/prefix (S3 and S3-compatible stores), or any "
        "fsspec URL (file:///dir, memory://name, gs://..., with that filesystem installed).",
    )
    endpoint_url: str | None = option(
        None,
        kind="str",
        doc="S3 API endpoint of an S3-compatible store (MinIO, Ceph RGW, ...): "
        "https://host:port. Default: AWS.",
    )
    region: str | None = option(
        None, kind="str", doc="Region of the bucket (default: the AWS chain's region)."
    )
    access_key_id: str | None = option(
        None,
        kind="secret",
        doc="Access key id; with secret_access_key, overrides the default AWS credential chain "
        "(environment, ~/.aws, instance role). Give it as {$env: NAME}; never shown.",
    )
    secret_access_key: str | None = option(
        None, kind="secret", doc="Secret access key ({$env: NAME}); never shown."
    )
    session_token: str | None = option(
        None,
        kind="secret",
        doc="Session token of temporary credentials ({$env: NAME}); never shown.",
    )
    server_side_encryption: str | None = option(
        None,
        kind="str",
        choices=("AES256", "aws:kms", "aws:kms:dsse"),
        doc="Server-side encryption of every object written (default: the bucket's).",
    )
    sse_kms_key_id: str | None = option(
        None, kind="str", doc="KMS key of server_side_encryption aws:kms (default: the AWS one)."
    )
    max_concurrency: int = option(
        16,
        minimum=1,
        maximum=256,
        doc="Requests in flight (I/O threads and HTTP connections of the pool).",
    )
    io_nice: int = option(
        0,
        minimum=0,
        maximum=19,
        doc="Niceness added to the I/O threads (encoding, checksums, HTTP; default 0: the "
        "process's priority). They run Python: when other processes load every core, a "
        "niced thread holding the GIL stalls the event loop and every other thread.",
    )
    connect_timeout_s: float = option(
        2.0, minimum=0.05, doc="Seconds to open a connection before the attempt fails."
    )
    read_timeout_s: float = option(
        10.0, minimum=0.05, doc="Seconds without a byte from the server before the attempt fails."
    )
    retries: int = option(
        2,
        minimum=0,
        maximum=20,
        doc="Retries of a failed request (so 1 + retries attempts), with exponential backoff "
        "and jitter (botocore's standard retry mode).",
    )
    multipart_threshold: int = option(
        "64MiB",
        kind="bytes",
        minimum=5 * MiB,
        doc="Objects this large or larger are uploaded in parts (S3 publishes the object "
        "only when every part is in: never partial).",
    )
    multipart_part_size: int = option(
        "16MiB", kind="bytes", minimum=5 * MiB, doc="Size of each part of a multipart upload."
    )
    conditional_put: bool = option(
        True,
        doc="Write with If-None-Match: * so that instances storing the same chunk do not "
        "overwrite each other (turned off by itself when the server refuses it).",
    )
    addressing_style: str = option(
        "auto",
        choices=("auto", "path", "virtual"),
        doc="Bucket addressing: path (https://host/bucket/key: MinIO, Ceph RGW) or virtual "
        "(https://bucket.host/key).",
    )
    tls_verify: bool = option(True, doc="Verify the endpoint's TLS certificate.")
    lookup_cache_s: float = option(
        10.0,
        minimum=0.0,
        doc="Seconds an existence answer 'stored' is reused by lookups (0: never).",
    )
    negative_cache_s: float = option(
        1.0,
        minimum=0.0,
        doc="Seconds an existence answer 'not stored' is reused by lookups (0: never); "
        "another host's new chunk is seen after at most this long.",
    )
    client: str = option(
        "auto",
        choices=("auto", "boto3", "fsspec"),
        doc="I/O path: auto (boto3 in a thread pool for s3://, measured faster than s3fs; "
        "fsspec for other URLs), or force one.",
    )

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if not parts.scheme or "://" not in self.url:
            raise ConfigError(
                f"expected a URL such as s3://bucket/prefix, got {self.url!r}", "options.url"
            )
        if parts.scheme == "s3":
            split_s3_url(self.url)
        if self.multipart_part_size > self.multipart_threshold:
            raise ConfigError(
                "multipart_part_size must not exceed multipart_threshold",
                "options.multipart_part_size",
            )
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError(
                "give access_key_id and secret_access_key together (or neither: the default "
                "AWS credential chain)",
                "options.secret_access_key",
            )
        if self.sse_kms_key_id is not None and not str(self.server_side_encryption).startswith(
            "aws:kms"
        ):
            raise ConfigError(
                "sse_kms_key_id needs server_side_encryption aws:kms", "options.sse_kms_key_id"
            )

    def __repr__(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("kind") == "secret" and value is not None:
                value = REDACTED
            parts.append(f"{f.name}={value!r}")
        return f"S3Options({', '.join(parts)})"

    __str__ = __repr__

    def secrets(self) -> list[str]:
        """The secret values set (to scrub them from any message)."""
        return [
            v
            for f in dataclasses.fields(self)
            if f.metadata.get("kind") == "secret" and (v := getattr(self, f.name))
        ]


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix/")`` (prefix may be empty)."""
    parts = urlsplit(url)
    bucket = parts.netloc
    if not bucket or "@" in bucket or ":" in bucket:
        raise ConfigError(
            f"expected s3://bucket/prefix, got {url!r} (credentials never go in the URL: use "
            "the access_key_id/secret_access_key options or the AWS chain)",
            "options.url",
        )
    prefix = parts.path.strip("/")
    return bucket, (prefix + "/" if prefix else "")
