"""Shared pieces of the core fault campaign (``tests/faults``).

CI runs a bounded sample with fixed seeds; ``LMCACHE_FAULTS_FULL=1`` (``make faults``)
runs the full trial counts that ``docs/reliability.md`` reports. Each test prints one
``FAULTS`` line with what it tried and what it found, so the campaign's numbers can be
read from ``pytest -s`` output.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pluggy
import torch

from lmcache_core.backend import BaseBackend, Capabilities
from lmcache_core.backends import builtin
from lmcache_core.config.options import option
from lmcache_core.keys import CacheEngineKey
from lmcache_core.plugins import hookimpl, hookspecs
from lmcache_core.plugins.registry import BackendRegistry

#: Full campaign (``make faults``) or the CI sample.
FULL = os.environ.get("LMCACHE_FAULTS_FULL") == "1"
#: Seed of every random choice in the campaign.
SEED = 20260410
_PAGE = os.sysconf("SC_PAGE_SIZE")


def trials(ci: int, full: int) -> int:
    """``full`` in the full campaign, ``ci`` otherwise."""
    return full if FULL else ci


def report(what: str, **counts: Any) -> None:
    """Print one result line of the campaign."""
    fields = " ".join(f"{k}={v}" for k, v in counts.items())
    print(f"\nFAULTS {what}: {fields} ({'full' if FULL else 'ci sample'})")


def rss_bytes() -> int:
    """Resident set size of this process now."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * _PAGE


@dataclass(frozen=True)
class DownOptions:
    """Nothing to configure but a label."""

    label: str = option("down", doc="A label.")


class DownBackend(BaseBackend):
    """A tier that is down: every operation raises ``OSError`` (a dead mount, a network
    partition), counting how often it was asked."""

    capabilities = Capabilities(bounded=False)
    Options = DownOptions

    def __init__(self, options: Any = None, **kw: Any) -> None:
        super().__init__(options, **kw)
        self.calls = 0

    def _fail(self) -> None:
        self.calls += 1
        raise OSError(5, "Input/output error (injected)")

    async def _contains(self, key: CacheEngineKey) -> bool:
        self._fail()
        return False

    async def _batched_contains(self, keys: Sequence[CacheEngineKey]) -> list[bool]:
        self._fail()
        return []

    async def _get(self, key: CacheEngineKey) -> torch.Tensor | None:
        self._fail()
        return None

    async def _put(self, key: CacheEngineKey, value: torch.Tensor, donate: bool) -> bool:
        self._fail()
        return False

    async def _remove(self, key: CacheEngineKey) -> bool:
        self._fail()
        return False


class _FaultPlugin:
    @hookimpl
    def lmcache_register_backends(self, registry: BackendRegistry) -> None:
        registry.add(DownBackend, name="down")


def make_registry() -> BackendRegistry:
    """The built-in backends plus ``down``, registered through the real hook."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name="lmcache-core")
    pm.register(_FaultPlugin(), name="faults")
    pm.check_pending()
    registry = BackendRegistry()
    pm.hook.lmcache_register_backends(registry=registry)
    return registry
