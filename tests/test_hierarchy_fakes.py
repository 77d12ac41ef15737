"""In-test backends for the hierarchy tests, registered as a plugin through the real hook.

* ``flaky``: a cpu backend that raises ``RuntimeError`` from every operation while
  ``failing`` is set (or ``KeyboardInterrupt`` with ``raise_base``).
* ``slow``: a cpu backend whose lookups, loads and stores sleep first (``*_delay_s``), and
  whose stores can be held by a gate (``hold_puts()`` / ``release_puts()``).
* ``fake``: a backend with a ``url`` option, for URL-scheme tests (scheme ``fake``).
* ``counting``: counts constructions and starts, to prove config loading opens nothing.
* ``ScannableBackend``: a file-per-chunk backend implementing ``scan`` for ``inspect``.

Other hierarchy tests import ``make_registry`` from here.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pluggy
import pytest
import torch

from lmcache_core import CPUBackend, CPUOptions
from lmcache_core.backend import BaseBackend, Capabilities
from lmcache_core.backends import builtin
from lmcache_core.config.options import build_options, option
from lmcache_core.keys import CacheEngineKey
from lmcache_core.maintenance import EntryInfo
from lmcache_core.plugins import hookimpl, hookspecs
from lmcache_core.plugins.registry import BackendRegistry


class FlakyBackend(CPUBackend):
    """cpu, plus a switch that makes every operation raise."""

    def __init__(self, options: Any = None, **kw: Any) -> None:
        super().__init__(options, **kw)
        self.failing = False
        self.raise_base: type[BaseException] | None = None
        self.calls = 0

    def _maybe_fail(self) -> None:
        self.calls += 1
        if self.raise_base is not None:
            raise self.raise_base()
        if self.failing:
            raise RuntimeError(f"injected failure in {self.name}")

    async def contains(self, key: CacheEngineKey) -> bool:
        self._maybe_fail()
        return await super().contains(key)

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        self._maybe_fail()
        return await super().batched_contains(keys)

    async def get(self, key: CacheEngineKey) -> torch.Tensor | None:
        self._maybe_fail()
        return await super().get(key)

    async def batched_get(self, keys: Sequence[CacheEngineKey]) -> list[torch.Tensor | None]:
        self._maybe_fail()
        return await super().batched_get(keys)

    async def get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        self._maybe_fail()
        return await super().get_into(key, out)

    async def batched_get_into(
        self, keys: Sequence[CacheEngineKey], outs: Sequence[torch.Tensor]
    ) -> list[bool]:
        self._maybe_fail()
        return await super().batched_get_into(keys, outs)

    async def put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool = False) -> bool:
        self._maybe_fail()
        return await super().put(key, value, donate)

    async def remove(self, key: CacheEngineKey) -> bool:
        self._maybe_fail()
        return await super().remove(key)


@dataclass(frozen=True)
class SlowOptions(CPUOptions):
    """cpu options plus delays."""

    lookup_delay_ms: float = option(0.0, doc="Sleep before each lookup.")
    load_delay_ms: float = option(0.0, doc="Sleep before each load.")
    put_delay_ms: float = option(0.0, doc="Sleep before each store.")


class SlowBackend(CPUBackend):
    """cpu, but lookups/loads/stores sleep first; stores can also wait on a gate."""

    Options = SlowOptions

    def __init__(self, options: Any = None, **kw: Any) -> None:
        opts = build_options(SlowOptions, options)
        super().__init__(opts, **kw)
        self.lookup_delay_s = opts.lookup_delay_ms / 1000
        self.load_delay_s = opts.load_delay_ms / 1000
        self.put_delay_s = opts.put_delay_ms / 1000
        self._gate: asyncio.Event | None = None
        self.puts_started = 0
        self.loads_finished = 0

    def hold_puts(self) -> None:
        self._gate = asyncio.Event()

    def release_puts(self) -> None:
        if self._gate is not None:
            self._gate.set()
            self._gate = None

    async def batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        if self.lookup_delay_s:
            await asyncio.sleep(self.lookup_delay_s)
        return await super().batched_contains(keys)

    async def _get(self, key: CacheEngineKey) -> torch.Tensor | None:
        if self.load_delay_s:
            await asyncio.sleep(self.load_delay_s)
        try:
            return await super()._get(key)
        finally:
            self.loads_finished += 1

    async def _get_into(self, key: CacheEngineKey, out: torch.Tensor) -> bool:
        if self.load_delay_s:
            await asyncio.sleep(self.load_delay_s)
        try:
            return await super()._get_into(key, out)
        finally:
            self.loads_finished += 1

    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        self.puts_started += 1
        if self._gate is not None:
            await self._gate.wait()
        if self.put_delay_s:
            await asyncio.sleep(self.put_delay_s)
        return await super()._put(key, value, donate)


@dataclass(frozen=True)
class FakeUrlOptions:
    """A URL and a secret."""

    url: str = option(kind="str", doc="Where the data lives.")
    token: str | None = option(None, kind="secret", doc="A secret token.")


class FakeUrlBackend(CPUBackend):
    """A cpu backend configured by URL (for the URL-scheme tests)."""

    Options = FakeUrlOptions
    capabilities = Capabilities(bounded=False)

    def __init__(self, options: Any = None, **kw: Any) -> None:
        self.url_options = build_options(FakeUrlOptions, options)
        super().__init__({"max_bytes": "64MiB"}, **kw)


@dataclass(frozen=True)
class CountingOptions:
    """A required option, to provoke validation errors."""

    size: int = option(1, doc="Anything.", minimum=1)


class CountingBackend(CPUBackend):
    """Counts how often it was constructed and started (config loading must do neither)."""

    Options = CountingOptions
    constructed: ClassVar[int] = 0
    started_count: ClassVar[int] = 0

    def __init__(self, options: Any = None, **kw: Any) -> None:
        type(self).constructed += 1
        super().__init__({"max_bytes": "16MiB"}, **kw)

    async def _start(self) -> None:
        type(self).started_count += 1
        await super()._start()


@dataclass(frozen=True)
class DirOptions:
    """A directory."""

    path: str = option(kind="path", doc="Directory of the objects.")


class ScannableBackend(BaseBackend):
    """One raw file per chunk (``<hash>.bin``, dtype uint8) with a ``scan`` for inspect."""

    Options = DirOptions
    capabilities = Capabilities(persistent=True)

    def __init__(self, options: Any = None, **kw: Any) -> None:
        opts = build_options(DirOptions, options)
        super().__init__(opts, **kw)
        self.root = Path(opts.path)

    def _file(self, key: CacheEngineKey) -> Path:
        return self.root / f"{key.chunk_hash:x}.bin"

    async def _start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    async def _contains(self, key: CacheEngineKey) -> bool:
        return self._file(key).exists()

    async def _get(self, key: CacheEngineKey) -> torch.Tensor | None:
        try:
            data = self._file(key).read_bytes()
        except FileNotFoundError:
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        self._file(key).write_bytes(value.contiguous().view(torch.uint8).numpy().tobytes())
        return True

    async def _remove(self, key: CacheEngineKey) -> bool:
        try:
            self._file(key).unlink()
        except FileNotFoundError:
            return False
        return True

    async def scan(
        self, *, read_headers: bool = False, progress: Any = None
    ) -> AsyncIterator[EntryInfo]:
        for p in sorted(self.root.glob("*.bin")):
            st = p.stat()
            yield EntryInfo(location=p.name, size=st.st_size, last_access=st.st_mtime,
                            namespace="raw" if read_headers else None)  # fmt: skip

    async def verify_entry(self, entry: EntryInfo) -> bool:
        return (self.root / entry.location).is_file()  # raw bytes: nothing more to check

    async def delete_entry(self, entry: EntryInfo) -> bool:
        try:
            (self.root / entry.location).unlink()
        except FileNotFoundError:
            return False
        return True


class HierarchyTestPlugin:
    """The in-test plugin: registers the backends above through the real hook."""

    @hookimpl
    def lmcache_register_backends(self, registry: BackendRegistry) -> None:
        registry.add(FlakyBackend, name="flaky")
        registry.add(SlowBackend, name="slow")
        registry.add(FakeUrlBackend, name="fake", schemes=("fake",))
        registry.add(CountingBackend, name="counting")


def make_registry() -> BackendRegistry:
    """A registry holding the built-in backends and the in-test plugin's."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name="lmcache-core")
    pm.register(HierarchyTestPlugin(), name="hierarchy-tests")
    pm.check_pending()
    registry = BackendRegistry()
    pm.hook.lmcache_register_backends(registry=registry)
    return registry


def wait_until(pred: Any, timeout: float = 5.0) -> None:
    """Poll ``pred`` (sync) until true (for subprocess/file tests)."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_registry_holds_the_in_test_plugins() -> None:
    reg = make_registry()
    assert {"cpu", "flaky", "slow", "fake", "counting"} <= set(reg.names())
    assert reg.for_scheme("fake").name == "fake"
    assert reg.get("slow").load() is SlowBackend


def test_scannable_backend_scans_what_it_stores(tmp_path: Any) -> None:
    from lmcache_core.testing import make_key, run_async

    async def body() -> int:
        b = ScannableBackend({"path": str(tmp_path)})
        await b.start()
        await b.put(make_key("s"), torch.arange(10, dtype=torch.uint8))
        n = 0
        async for e in b.scan():
            n += 1
            assert e.size == 10
        await b.close()
        return n

    assert run_async(body()) == 1
    assert os.listdir(tmp_path)


@pytest.fixture
def registry() -> BackendRegistry:
    return make_registry()
