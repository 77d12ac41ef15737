"""Optional maintenance interface for persistent tiers (``inspect``, ``verify``, ``gc``).

A backend that stores objects somewhere durable (a directory, a bucket) implements
:class:`MaintainableBackend` in addition to :class:`~lmcache_core.StorageBackend`; the
``lmcache-core inspect/verify/gc`` commands then work on it whatever it is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["EntryInfo", "MaintainableBackend", "ProgressCallback"]

#: ``progress(done, total_or_None)`` called now and then during long scans.
ProgressCallback = Callable[[int, int | None], None]


@dataclass(frozen=True)
class EntryInfo:
    """One stored object as a scan sees it (the header is read only when asked)."""

    location: str  # backend-specific (a relative path, an object key)
    size: int  # bytes on the medium
    last_access: float  # unix time of the last read or write, as well as the tier knows
    key: str | None = None  # CacheEngineKey string, when read from the header
    namespace: str | None = None  # namespace JSON, when read from the header


@runtime_checkable
class MaintainableBackend(Protocol):
    """Scan, verify and delete stored objects."""

    def scan(
        self, *, read_headers: bool = False, progress: ProgressCallback | None = None
    ) -> AsyncIterator[EntryInfo]:
        """Every stored object (with key/namespace when ``read_headers``)."""
        ...

    async def verify_entry(self, entry: EntryInfo) -> bool:
        """Read the object fully and check size, header and checksum."""
        ...

    async def delete_entry(self, entry: EntryInfo) -> bool:
        """Delete one object; ``True`` when something was deleted."""
        ...
