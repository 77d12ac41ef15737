"""Real backends with faults and delays injected at run time, for the vLLM tests only.

Selected through the configuration's ``backend_class`` escape hatch
(``"kv_test_backends:FaultyCPUBackend"``; the engine process needs this directory on
``PYTHONPATH``). Their extra option ``control`` names a JSON file read on every call::

    {"fail": ["<chunk hash hex>", ...],   # loads of these chunks miss (on every rank)
     "fail_keys": ["<key string>", ...],  # loads of these keys miss (one rank's copy)
     "lookup_delay_s": 0.02, "get_delay_s": 2.0, "put_delay_s": 0.0}

so a test changes a running engine's storage behaviour by rewriting that file.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lmcache_backend_disk.backend import DiskBackend
from lmcache_backend_disk.options import DiskOptions

from lmcache_core.backends.cpu import CPUBackend, CPUOptions
from lmcache_core.config.options import build_options, option
from lmcache_core.keys import CacheEngineKey


class Control:
    """The control file, re-read when it changes."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._data: dict[str, Any] = {}

    def get(self) -> dict[str, Any]:
        if not self.path:
            return {}
        try:
            st = os.stat(self.path)
        except OSError:
            return {}
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            try:
                with open(self.path) as f:
                    self._data = json.load(f)
                self._stamp = stamp
            except (OSError, ValueError):
                return self._data
        return self._data

    def fails(self, key: CacheEngineKey) -> bool:
        d = self.get()
        return key.chunk_hash_hex in set(d.get("fail", ())) or str(key) in set(
            d.get("fail_keys", ())
        )

    async def delay(self, what: str) -> None:
        s = float(self.get().get(f"{what}_delay_s", 0.0))
        if s > 0:
            await asyncio.sleep(s)


def write_control(path: str, **values: Any) -> None:
    """Atomically replace the control file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(values, f)
    os.replace(tmp, path)


@dataclass(frozen=True)
class FaultyCPUOptions(CPUOptions):
    control: str | None = option(None, kind="path", doc="Control file (see module doc).")


class FaultyCPUBackend(CPUBackend):
    """The ``cpu`` backend whose loads of listed chunks miss (as if evicted or corrupt)."""

    Options = FaultyCPUOptions

    def __init__(self, options: Any = None, **kw: Any) -> None:
        opts = build_options(FaultyCPUOptions, options)
        super().__init__(opts, **kw)
        self.control = Control(opts.control)

    async def _get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        await self.control.delay("get")
        if self.control.fails(key):
            return False
        return await super()._get_into(key, out)

    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        await self.control.delay("put")
        return await super()._put(key, value, donate)

    def try_reserve_threadsafe(
        self, dtype: torch.dtype, shape: Sequence[int], fresh: bool = True
    ) -> tuple[object, torch.Tensor] | None:
        # Stores are delayed in _put: while a delay is set, no reserved puts (they would
        # bypass it), so saves take the copying path the delay applies to.
        if float(self.control.get().get("put_delay_s", 0.0)) > 0:
            return None
        return super().try_reserve_threadsafe(dtype, shape, fresh)

    def try_batched_get_into_threadsafe(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool | None] | None:
        res = super().try_batched_get_into_threadsafe(keys, outs)
        if res is None:
            return None
        return [False if self.control.fails(k) else r for k, r in zip(keys, res, strict=True)]

    def try_borrow_threadsafe(
        self, keys: Sequence[CacheEngineKey]
    ) -> list[tuple[object, torch.Tensor] | None] | None:
        res = super().try_borrow_threadsafe(keys)
        if res is None:
            return None
        out: list[tuple[object, torch.Tensor] | None] = []
        for k, r in zip(keys, res, strict=True):
            if r is not None and self.control.fails(k):
                self.end_borrows([r[0]])  # a listed chunk misses, as in the copying path
                r = None
            out.append(r)
        return out


@dataclass(frozen=True)
class SlowDiskOptions(DiskOptions):
    control: str | None = option(None, kind="path", doc="Control file (see module doc).")


class SlowDiskBackend(DiskBackend):
    """The ``disk`` backend with delays on lookups, loads and stores, and failing chunks."""

    Options = SlowDiskOptions

    def __init__(self, options: Any = None, **kw: Any) -> None:
        opts = build_options(SlowDiskOptions, options)
        super().__init__(opts, **kw)
        self.control = Control(opts.control)

    async def _batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        await self.control.delay("lookup")
        return await super()._batched_contains(keys)

    async def _contains(self, key: CacheEngineKey) -> bool:
        await self.control.delay("lookup")
        return await super()._contains(key)

    async def _batched_get_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool]:
        await self.control.delay("get")
        res = await super()._batched_get_into(keys, outs)
        return [r and not self.control.fails(k) for k, r in zip(keys, res, strict=True)]

    async def _get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        await self.control.delay("get")
        return not self.control.fails(key) and await super()._get_into(key, out)

    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        await self.control.delay("put")
        return await super()._put(key, value, donate)
