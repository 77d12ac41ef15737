"""Backend classes that get the declared interface wrong, one mistake each."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lmcfix_backend import FixtureBackend

from lmcache_core.keys import CacheEngineKey


class FutureBackend(FixtureBackend):
    """Written for an interface this lmcache-core does not have yet."""

    interface_version = "2.0"


class HalfPinsBackend(FixtureBackend):
    """Can pin but not unpin."""

    interface_version = "1.0"

    def pin(self, key: CacheEngineKey) -> object | None:
        return None


class SyncPutBackend(FixtureBackend):
    """``put`` written as a plain function."""

    interface_version = "1.0"

    def put(self, key: Any, value: Any, donate: bool = False) -> bool:  # type: ignore[override]
        return False


class ReconcileOnlyBackend(FixtureBackend):
    """``reconcile`` without the maintenance interface it belongs to."""

    interface_version = "1.0"

    async def reconcile(self) -> dict[str, int]:
        return {}


class ThreadSafeContainsBackend(FixtureBackend):
    """A complete optional capability (thread-safe contains) and a declared version."""

    interface_version = "1.0"

    def try_batched_contains_threadsafe(
        self, keys: Sequence[CacheEngineKey]
    ) -> list[bool | None] | None:
        return None
