"""The base class of storage backends.

The interface itself (:class:`StorageBackend`, the optional capabilities, the interface
version) is declared in :mod:`lmcache_core.interface`; it is re-exported here. Every tier (CPU memory, local disk, S3, GPUDirect Storage, ... and the
:class:`~lmcache_core.TieredHierarchy` itself) implements :class:`StorageBackend`.
:class:`BaseBackend` provides the life cycle (``start``/``close`` idempotence, closed
errors), argument checks, statistics and the batched variants; a backend implements the
single operations (``_contains``, ``_get``, ``_put``, ``_remove``) and may override
``_get_into`` and the ``_batched_*`` hooks with faster native versions.

Semantics every backend follows (the contract suite in :mod:`lmcache_core.testing`
checks them):

* ``start()`` is idempotent and is the only place for set-up I/O (never the constructor).
* ``get`` returns ``None`` for a missing key and never raises for a miss; the returned
  tensor belongs to the caller.
* ``get_into(key, out)`` writes into a caller-owned contiguous tensor and returns ``True``
  on a hit; ``out`` with the wrong dtype or shape raises
  :class:`~lmcache_core.errors.BufferMismatchError`; after a miss its contents are
  unspecified.
* ``put`` is an idempotent overwrite and returns whether the value is now stored. It
  copies the value unless ``donate=True``; a backend never keeps the caller's storage.
  A key whose string is longer than :data:`~lmcache_core.keys.MAX_KEY_BYTES` is refused
  with :class:`~lmcache_core.errors.KeyFormatError` (it could be written but never read).
* batched variants keep the order of their input (duplicates included).
* ``close()`` is idempotent; any other call afterwards raises
  :class:`~lmcache_core.errors.BackendClosedError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, TypeVar

import torch

from .errors import BackendClosedError, BackendNotStartedError, BufferMismatchError
from .interface import REQUIRED_METHODS, Capabilities, StorageBackend
from .keys import CacheEngineKey, Namespace, check_key_size

__all__ = [
    "REQUIRED_METHODS",
    "BackendStats",
    "BaseBackend",
    "Capabilities",
    "StorageBackend",
]

T = TypeVar("T")


@dataclass
class BackendStats:
    """Counters every :class:`BaseBackend` keeps (backends may add their own)."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected_puts: int = 0
    removes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


class BaseBackend:
    """Base class with life cycle, checks, statistics and batched operations.

    Subclasses set ``capabilities`` and implement ``_contains``, ``_get``, ``_put`` and
    ``_remove`` (plus ``_start``/``_close`` when they hold resources). Constructors take
    ``options`` (the backend's validated ``Options`` or a mapping), ``namespace`` (the
    identity stored objects must carry) and ``name``; they must do no I/O.
    """

    capabilities: ClassVar[Capabilities] = Capabilities()
    #: How many single operations the default batched variants run at once.
    batch_concurrency: int = 16

    def __init__(
        self,
        options: Any = None,
        *,
        namespace: Namespace | None = None,
        name: str | None = None,
    ) -> None:
        self.options = options
        self.namespace = namespace
        self.name = name or type(self).__name__
        self._state = "new"  # new -> started -> closed
        self._stats = BackendStats()
        self._start_lock: asyncio.Lock | None = None

    # ------------------------------------------------------------------ life cycle
    @property
    def started(self) -> bool:
        return self._state == "started"

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    async def start(self) -> None:
        """Open resources. Idempotent; raises :class:`BackendClosedError` after close."""
        if self._state == "started":
            return
        if self._state == "closed":
            raise BackendClosedError(f"backend {self.name!r} is closed and cannot be restarted")
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._state == "new":
                await self._start()
                self._state = "started"

    async def close(self) -> None:
        """Release resources. Idempotent."""
        if self._state == "closed":
            return
        was_started = self._state == "started"
        self._state = "closed"
        if was_started:
            await self._close()

    async def __aenter__(self: T) -> T:
        await self.start()  # type: ignore[attr-defined]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check(self) -> None:
        if self._state != "started":
            if self._state == "closed":
                raise BackendClosedError(f"backend {self.name!r} is closed")
            raise BackendNotStartedError(
                f"backend {self.name!r} is not started: await start() first"
            )

    # ------------------------------------------------------------------ single ops
    async def contains(self, key: CacheEngineKey) -> bool:
        """Whether ``key`` is stored (a cheap check; ``get`` may still miss later)."""
        self._check()
        _check_key(key)
        return await self._contains(key)

    async def get(self, key: CacheEngineKey) -> torch.Tensor | None:
        """The stored tensor (owned by the caller), or ``None``."""
        self._check()
        _check_key(key)
        value = await self._get(key)
        self._count_read(value is not None, 0 if value is None else _nbytes(value))
        return value

    async def get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        """Load ``key`` into ``out``; ``True`` on a hit. See the module docstring."""
        self._check()
        _check_key(key)
        _check_out(out)
        hit = await self._get_into(key, out)
        self._count_read(hit, _nbytes(out) if hit else 0)
        return hit

    async def put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool = False) -> bool:
        """Store ``value`` under ``key`` (overwriting); ``True`` when stored."""
        self._check()
        _check_put_key(key)
        _check_value(value)
        stored = await self._put(key, value, donate)
        if stored:
            self._stats.puts += 1
            self._stats.bytes_written += _nbytes(value)
        else:
            self._stats.rejected_puts += 1
        return stored

    async def remove(self, key: CacheEngineKey) -> bool:
        """Delete ``key``; ``True`` when something was removed."""
        self._check()
        _check_key(key)
        removed = await self._remove(key)
        if removed:
            self._stats.removes += 1
        return removed

    # ------------------------------------------------------------------ batched ops
    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        """``contains`` for each key, in order."""
        self._check()
        for k in keys:
            _check_key(k)
        return await self._batched_contains(keys)

    async def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[torch.Tensor | None]:
        """``get`` for each key, in order."""
        self._check()
        for k in keys:
            _check_key(k)
        values = await self._batched_get(keys)
        for v in values:
            self._count_read(v is not None, 0 if v is None else _nbytes(v))
        return values

    async def batched_get_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool]:
        """``get_into`` for each (key, out) pair, in order. Outs must not alias."""
        self._check()
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output buffers")
        for k, o in zip(keys, outs, strict=True):
            _check_key(k)
            _check_out(o)
        hits = await self._batched_get_into(keys, outs)
        for hit, o in zip(hits, outs, strict=True):
            self._count_read(hit, _nbytes(o) if hit else 0)
        return hits

    async def batched_put(
        self,
        keys: Sequence[CacheEngineKey],
        values: Sequence[torch.Tensor],
        donate: bool = False,
    ) -> list[bool]:
        """``put`` for each (key, value) pair, in order (a later duplicate wins)."""
        self._check()
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        for k, v in zip(keys, values, strict=True):
            _check_put_key(k)
            _check_value(v)
        results = await self._batched_put(keys, values, donate)
        for ok, v in zip(results, values, strict=True):
            if ok:
                self._stats.puts += 1
                self._stats.bytes_written += _nbytes(v)
            else:
                self._stats.rejected_puts += 1
        return results

    # ------------------------------------------------------------------ statistics
    def stats(self) -> dict[str, Any]:
        """Counters and usage (a fresh dict; safe to serialise as JSON)."""
        d = self._stats.as_dict()
        d["name"] = self.name
        d["state"] = self._state
        d.update(self._usage())
        return d

    def _usage(self) -> dict[str, Any]:
        """Backend-specific usage figures (``used_bytes``, ``entries``, ...)."""
        return {}

    def _count_read(self, hit: bool, nbytes: int) -> None:
        if hit:
            self._stats.hits += 1
            self._stats.bytes_read += nbytes
        else:
            self._stats.misses += 1

    # ------------------------------------------------------------------ to implement
    async def _start(self) -> None:
        """Open resources (I/O allowed). Called once."""

    async def _close(self) -> None:
        """Release resources. Called once, only after a successful start."""

    async def _contains(self, key: CacheEngineKey) -> bool:
        raise NotImplementedError

    async def _get(self, key: CacheEngineKey) -> torch.Tensor | None:
        raise NotImplementedError

    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        raise NotImplementedError

    async def _remove(self, key: CacheEngineKey) -> bool:
        raise NotImplementedError

    async def _get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        value = await self._get(key)
        if value is None:
            return False
        if value.dtype != out.dtype or value.shape != out.shape:
            raise BufferMismatchError(
                f"output tensor is {out.dtype}{list(out.shape)}, stored chunk is "
                f"{value.dtype}{list(value.shape)}"
            )
        out.copy_(value)
        return True

    async def _batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        return await self._bounded([partial(self._contains, k) for k in keys])

    async def _batched_get(self, keys: Sequence[CacheEngineKey]) -> list[torch.Tensor | None]:
        return await self._bounded([partial(self._get, k) for k in keys])

    async def _batched_get_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool]:
        return await self._bounded(
            [partial(self._get_into, k, o) for k, o in zip(keys, outs, strict=True)]
        )

    async def _batched_put(
        self, keys: Sequence[CacheEngineKey], values: Sequence[torch.Tensor], donate: bool
    ) -> list[bool]:
        # Duplicated keys are written in order so the last value wins, as with single puts.
        if len(set(keys)) != len(keys):
            return [await self._put(k, v, donate) for k, v in zip(keys, values, strict=True)]
        return await self._bounded(
            [partial(self._put, k, v, donate) for k, v in zip(keys, values, strict=True)]
        )

    async def _bounded(self, thunks: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
        """Run coroutine factories with at most ``batch_concurrency`` in flight, in order."""
        if len(thunks) <= 1:
            return [await t() for t in thunks]
        sem = asyncio.Semaphore(self.batch_concurrency)

        async def one(thunk: Callable[[], Awaitable[T]]) -> T:
            async with sem:
                return await thunk()

        return list(await asyncio.gather(*(one(t) for t in thunks)))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_key(key: object) -> None:
    if not isinstance(key, CacheEngineKey):
        raise TypeError(f"expected a CacheEngineKey, got {type(key).__name__}")


def _check_put_key(key: object) -> None:
    """A key that can be stored: its string fits an object header (see check_key_size)."""
    _check_key(key)
    check_key_size(key)  # type: ignore[arg-type]


def _check_value(value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor value, got {type(value).__name__}")


def _check_out(out: object) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor output buffer, got {type(out).__name__}")
    if not out.is_contiguous():
        raise BufferMismatchError("output buffer must be contiguous")
