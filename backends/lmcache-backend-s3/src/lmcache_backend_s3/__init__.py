"""lmcache-backend-s3: the remote tier of lmcache-core (backend name ``s3``, ``s3://`` URLs).

KV chunks as objects in an S3 bucket (or under any fsspec URL), shared by every host that
opens the same bucket and prefix; checksummed, never partial, unbounded by design (bound
the bucket with ``lmcache-core gc`` and lifecycle rules). See ``docs/backends/s3.md``.

Importing this package is cheap: :class:`S3Backend` and :class:`S3Options` are imported on
first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["S3Backend", "S3Options", "__version__"]

if TYPE_CHECKING:
    from .backend import S3Backend
    from .options import S3Options


def __getattr__(name: str) -> Any:
    if name == "S3Backend":
        from .backend import S3Backend

        return S3Backend
    if name == "S3Options":
        from .options import S3Options

        return S3Options
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
