"""``open_backend``: one backend from a URL or a name, the front door (like fsspec's
``filesystem()``).

::

    async with open_backend("disk:///var/cache/kv?max_bytes=64GiB") as tier:
        await tier.put(key, value)

    tier = await open_backend("disk", path="/var/cache/kv", max_bytes="64GiB")
    ...
    await tier.close()

The URL's scheme picks the backend (a registered scheme such as ``file`` or ``s3``, or a
backend's name); the rest of the URL fills its ``url`` option, or its ``path`` option when
it has no ``url``; the query string and the keyword arguments are its options, validated
against the backend's ``Options`` exactly as a configured tier's are (text is converted:
``max_bytes=64GiB``, ``fsync=false``). Every mistake is a
:class:`~lmcache_core.errors.ConfigError` saying where (``options.max_byte: unknown
option; did you mean 'max_bytes'?``, ``backend: no backend handles URL scheme 'dsk';
did you mean 'disk'?``) and nothing is opened.
"""

from __future__ import annotations

from collections.abc import Generator
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl

from .config import load_config
from .errors import ConfigError
from .interface import StorageBackend
from .keys import Namespace

__all__ = ["OpeningBackend", "make_backend", "open_backend"]

_TIER = "tiers[0]."


def _split_query(spec: str) -> tuple[str, dict[str, str]]:
    base, sep, query = spec.partition("?")
    if "#" in (query if sep else base):
        raise ConfigError("a backend URL takes no #fragment", "backend")
    if not sep:
        return base, {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as exc:
        raise ConfigError(f"invalid query string: {exc}", "backend") from None
    out: dict[str, str] = {}
    for k, v in pairs:
        if k in out:
            raise ConfigError("given twice in the query string", f"options.{k}")
        out[k] = v
    return base, out


def make_backend(
    spec: str,
    /,
    *,
    namespace: Namespace | str | None = None,
    registry: Any = None,
    **options: Any,
) -> StorageBackend:
    """The backend :func:`open_backend` would open, not started (no I/O).

    ``namespace`` is whose chunks the backend stores: a :class:`~lmcache_core.keys.Namespace`,
    a name (text), or ``None`` for the namespace named ``default``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"expected a backend name or URL, got {spec!r}", "backend")
    base, query = _split_query(spec.strip())
    both = sorted(query.keys() & options.keys())
    if both:
        raise ConfigError(
            "given both in the URL's query string and as an argument", f"options.{both[0]}"
        )
    if "://" not in base and query:
        raise ConfigError("a query string needs a URL (scheme://...)", "backend")
    doc: dict[str, Any] = {"tiers": [{"backend": base, "options": {**query, **options}}]}
    if isinstance(namespace, str):
        doc["namespace"] = namespace
    elif namespace is not None and not isinstance(namespace, Namespace):
        raise ConfigError(
            f"expected a Namespace, a name or None, got {type(namespace).__name__}", "namespace"
        )
    try:
        cfg = load_config(doc, registry=registry)
    except ConfigError as exc:
        path = exc.path[len(_TIER) :] if exc.path.startswith(_TIER) else exc.path
        raise ConfigError(exc.reason, path) from None
    from .config.namespaces import resolve_namespace

    ns = resolve_namespace(cfg, namespace if isinstance(namespace, Namespace) else None)
    backend: StorageBackend = cfg.tiers[0].create_backend(ns)
    return backend


class OpeningBackend:
    """What :func:`open_backend` returns: ``await`` it for the started backend (close it
    yourself), or use it as ``async with`` (closed at the end)."""

    def __init__(self, backend: StorageBackend) -> None:
        self.backend = backend

    async def _open(self) -> StorageBackend:
        try:
            await self.backend.start()
        except BaseException:
            await self.backend.close()
            raise
        return self.backend

    def __await__(self) -> Generator[Any, None, StorageBackend]:
        return self._open().__await__()

    async def __aenter__(self) -> StorageBackend:
        return await self._open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.backend.close()


def open_backend(
    spec: str,
    /,
    *,
    namespace: Namespace | str | None = None,
    registry: Any = None,
    **options: Any,
) -> OpeningBackend:
    """Open one backend from a URL (``"disk:///var/cache/kv?max_bytes=64GiB"``) or a name
    and keyword options (``open_backend("disk", path=..., max_bytes="64GiB")``).

    Use ``async with open_backend(...) as b:`` or ``b = await open_backend(...)``.
    Invalid input raises :class:`~lmcache_core.errors.ConfigError` at once, before
    anything is opened; ``registry`` resolves names (default: the process-wide one).
    """
    return OpeningBackend(make_backend(spec, namespace=namespace, registry=registry, **options))
