"""The ``gds`` backend: KV chunks between NVMe files and (device) memory.

A ``gds`` tier is one directory (``path``) or several striped by key (``paths``). Each
directory is a :class:`~.stripe.GdsStripe`: the disk tier (its layout, shared index,
sandbox, crash-safe publication and verified reads - imported, not copied) plus device
transfers through kvikio's ``CuFile``. With a single ``path`` the directory is exactly a
``disk`` tier's: a ``disk`` backend opened on it reads what ``gds`` wrote and the other
way round, even both at once.

At :meth:`start` the backend decides its I/O path (:mod:`.runtime`): ``gds`` (cuFile with
GPUDirect Storage), ``compat`` (kvikio in compatibility mode) or ``posix`` (its own
``O_DIRECT`` path with aligned host buffers - kvikio missing or unusable, e.g. without a
CUDA driver, or ``force_posix``); it says which once in the log, in ``stats()``
(``io_path``) and in ``lmcache-core backends``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from lmcache_core.backend import BaseBackend, Capabilities
from lmcache_core.config.options import build_options
from lmcache_core.keys import CacheEngineKey, Namespace
from lmcache_core.maintenance import EntryInfo, ProgressCallback

from . import runtime
from .options import GdsOptions, stripe_roots
from .stripe import GdsStripe

__all__ = ["GdsBackend", "GdsPin"]

T = TypeVar("T")
_META = ".lmcache-disk"


@dataclass(frozen=True, slots=True)
class GdsPin:
    """A pin handle: the stripe that holds the entry and that stripe's own handle."""

    stripe: int
    handle: Any


class GdsBackend(BaseBackend):
    """NVMe tier through GPUDirect Storage, with a POSIX ``O_DIRECT`` fallback."""

    Options = GdsOptions
    interface_version = "1.0"  # the lmcache_core.interface version it implements
    capabilities = Capabilities(persistent=True, shared=True, bounded=True, zero_copy=False)

    def __init__(
        self, options: Any = None, *, namespace: Namespace | None = None, name: str | None = None
    ) -> None:
        opts = build_options(GdsOptions, options)
        super().__init__(opts, namespace=namespace, name=name or "gds")
        self.opts = opts
        self.roots = stripe_roots(opts)
        self.max_bytes = opts.max_bytes
        self.batch_concurrency = opts.io_threads
        share = max(1, opts.max_bytes // len(self.roots))
        self.stripes = [
            GdsStripe(
                {
                    "path": root,
                    "max_bytes": share,
                    "mode": opts.mode,
                    "fsync": opts.fsync,
                    "concurrency": opts.io_threads,
                    "io_nice": opts.io_nice,
                    "pin_seconds": opts.pin_seconds,
                },
                namespace=namespace,
                name=self.name if len(self.roots) == 1 else f"{self.name}[{i}]",
                task_size=opts.task_size,
            )
            for i, root in enumerate(self.roots)
        ]
        self.io_path: runtime.IoPath | None = None

    @classmethod
    def runtime_note(cls) -> str:
        """The I/O path a tier would use in this process (``lmcache-core backends``)."""
        return runtime.describe()

    # ------------------------------------------------------------------ life cycle
    async def _start(self) -> None:
        started: list[GdsStripe] = []
        try:
            for s in self.stripes:
                await s.start()
                started.append(s)
            loop = asyncio.get_running_loop()
            probe_dir = f"{self.roots[0]}/{_META}"
            path = await loop.run_in_executor(
                None, lambda: runtime.probe(probe_dir, force_posix=self.opts.force_posix)
            )
            kvikio = None
            if path.uses_kvikio:
                kvikio = runtime.import_kvikio()
                runtime.configure(kvikio, self.opts.io_threads, self.opts.task_size)
            for s in self.stripes:
                s.use_io_path(path, kvikio)
            self.io_path = path
            where = self.roots[0] if len(self.roots) == 1 else ", ".join(self.roots)
            runtime.log_once(path, where)
        except BaseException:
            for s in started:
                await s.close()
            raise

    async def _close(self) -> None:
        await asyncio.gather(*(s.close() for s in self.stripes))

    # ------------------------------------------------------------------ routing
    def stripe_index(self, key: CacheEngineKey) -> int:
        """Which directory holds ``key`` (stable across processes and machines)."""
        n = len(self.stripes)
        return 0 if n == 1 else int(key.to_path()[-8:], 16) % n

    def _stripe(self, key: CacheEngineKey) -> GdsStripe:
        return self.stripes[self.stripe_index(key)]

    async def _fan_out(
        self,
        keys: Sequence[CacheEngineKey],
        call: Callable[[GdsStripe, list[int]], Awaitable[Sequence[T]]],
    ) -> list[T]:
        """``call(stripe, positions)`` once per stripe holding some of ``keys``
        (concurrently); the results put back in the order of ``keys``."""
        if len(self.stripes) == 1:
            return list(await call(self.stripes[0], list(range(len(keys)))))
        groups: dict[int, list[int]] = {}
        for pos, k in enumerate(keys):
            groups.setdefault(self.stripe_index(k), []).append(pos)
        out: list[Any] = [None] * len(keys)

        async def one(i: int, positions: list[int]) -> None:
            part = await call(self.stripes[i], positions)
            for pos, r in zip(positions, part, strict=True):
                out[pos] = r

        await asyncio.gather(*(one(i, p) for i, p in groups.items()))
        return out

    # ------------------------------------------------------------------ operations
    async def _contains(self, key: CacheEngineKey) -> bool:
        return await self._stripe(key).contains(key)

    async def _get(self, key: CacheEngineKey) -> torch.Tensor | None:
        return await self._stripe(key).get(key)

    async def _get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        return await self._stripe(key).get_into(key, out)

    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        return await self._stripe(key).put(key, value, donate)

    async def _remove(self, key: CacheEngineKey) -> bool:
        return await self._stripe(key).remove(key)

    async def _batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        return await self._fan_out(keys, lambda s, p: s.batched_contains([keys[i] for i in p]))

    async def _batched_get(self, keys: Sequence[CacheEngineKey]) -> list[torch.Tensor | None]:
        return await self._fan_out(keys, lambda s, p: s.batched_get([keys[i] for i in p]))

    async def _batched_get_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool]:
        return await self._fan_out(
            keys, lambda s, p: s.batched_get_into([keys[i] for i in p], [outs[i] for i in p])
        )

    async def _batched_put(
        self, keys: Sequence[CacheEngineKey], values: Sequence[torch.Tensor], donate: bool
    ) -> list[bool]:
        # a key always maps to one stripe, so duplicates stay in order within it
        return await self._fan_out(
            keys,
            lambda s, p: s.batched_put([keys[i] for i in p], [values[i] for i in p], donate),
        )

    # ------------------------------------------------------------------ pins
    def pin(self, key: CacheEngineKey, ttl_s: float | None = None) -> GdsPin | None:
        """Keep ``key``'s entry from eviction in every process (see the disk tier's pins)."""
        i = self.stripe_index(key)
        handle = self.stripes[i].pin(key, ttl_s)
        return None if handle is None else GdsPin(i, handle)

    def unpin(self, handle: GdsPin) -> None:
        """Release a pin taken by :meth:`pin` or :meth:`pin_many`."""
        self.stripes[handle.stripe].unpin(handle.handle)

    def pin_many(
        self, keys: Sequence[CacheEngineKey], ttl_s: float | None = None
    ) -> list[GdsPin | None]:
        """:meth:`pin` for each key (one index transaction per stripe)."""
        out: list[GdsPin | None] = [None] * len(keys)
        groups: dict[int, list[int]] = {}
        for pos, k in enumerate(keys):
            groups.setdefault(self.stripe_index(k), []).append(pos)
        for i, positions in groups.items():
            handles = self.stripes[i].pin_many([keys[p] for p in positions], ttl_s)
            for pos, h in zip(positions, handles, strict=True):
                out[pos] = None if h is None else GdsPin(i, h)
        return out

    def unpin_many(self, handles: Sequence[GdsPin]) -> None:
        """Release pins (grouped by stripe)."""
        groups: dict[int, list[Any]] = {}
        for h in handles:
            groups.setdefault(h.stripe, []).append(h.handle)
        for i, hs in groups.items():
            self.stripes[i].unpin_many(hs)

    # ------------------------------------------------------------------ maintenance
    def _location(self, i: int, rel: str) -> str:
        return rel if len(self.stripes) == 1 else f"{i}:{rel}"

    def _split(self, entry: EntryInfo) -> tuple[GdsStripe, EntryInfo]:
        if len(self.stripes) == 1:
            return self.stripes[0], entry
        head, sep, rel = entry.location.partition(":")
        if not sep or not head.isdigit() or int(head) >= len(self.stripes):
            raise ValueError(f"{entry.location!r} is not a location of this gds tier")
        return self.stripes[int(head)], EntryInfo(
            rel, entry.size, entry.last_access, entry.key, entry.namespace
        )

    async def scan(
        self, *, read_headers: bool = False, progress: ProgressCallback | None = None
    ) -> AsyncIterator[EntryInfo]:
        """Every object file of every directory (locations ``<stripe>:<path>`` when
        striped, the disk tier's relative paths otherwise)."""
        self._check()
        for i, s in enumerate(self.stripes):
            async for e in s.scan(read_headers=read_headers, progress=progress):
                yield EntryInfo(
                    self._location(i, e.location), e.size, e.last_access, e.key, e.namespace
                )

    async def check_entry(self, entry: EntryInfo) -> str | None:
        """``None`` when the object is sound, else why not (see the disk tier)."""
        self._check()
        try:
            stripe, inner = self._split(entry)
        except ValueError as exc:
            return str(exc)
        return await stripe.check_entry(inner)

    async def verify_entry(self, entry: EntryInfo) -> bool:
        """Read the object fully and check size, header, location and checksum."""
        return await self.check_entry(entry) is None

    async def delete_entry(self, entry: EntryInfo) -> bool:
        """Delete one object (and its index row)."""
        self._check()
        stripe, inner = self._split(entry)
        return await stripe.delete_entry(inner)

    async def usage(self) -> dict[str, Any]:
        """Bytes used and entries, summed over the directories; the recorded bounds."""
        self._check()
        parts = [await s.usage() for s in self.stripes]
        bounds = [p.get("max_bytes") for p in parts]
        return {
            "used_bytes": sum(int(p["used_bytes"]) for p in parts),
            "entries": sum(int(p["entries"]) for p in parts),
            "max_bytes": None if None in bounds else sum(int(b) for b in bounds if b is not None),
        }

    async def reconcile(self) -> dict[str, int]:
        """The disk tier's reconcile on every directory (counts summed)."""
        self._check()
        total: dict[str, int] = {}
        for s in self.stripes:
            for k, v in (await s.reconcile()).items():
                total[k] = total.get(k, 0) + v
        return total

    async def namespaces(self) -> dict[str, str | None]:
        """Namespace directories and their JSON (merged over the directories)."""
        self._check()
        out: dict[str, str | None] = {}
        for s in self.stripes:
            out.update(await s.namespaces())
        return out

    # ------------------------------------------------------------------ introspection
    def _usage(self) -> dict[str, Any]:
        parts = [s._usage() for s in self.stripes]
        merged: dict[str, Any] = dict(parts[0])
        for p in parts[1:]:
            for k, v in p.items():
                if isinstance(v, bool):
                    merged[k] = merged[k] and v
                elif isinstance(v, (int, float)):
                    merged[k] = merged[k] + v
        merged["path"] = self.roots[0] if len(self.roots) == 1 else list(self.roots)
        merged["max_bytes"] = self.max_bytes
        merged["stripes"] = len(self.stripes)
        path = self.io_path
        merged["io_path"] = path.mode if path is not None else None
        merged["io_path_reason"] = path.reason if path is not None else None
        return merged
