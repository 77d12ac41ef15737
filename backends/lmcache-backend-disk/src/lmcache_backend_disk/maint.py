"""Maintenance of a disk tier: scan, verify, delete, reconcile (``inspect``/``verify``/``gc``).

:class:`DiskMaintenance` is mixed into :class:`~lmcache_backend_disk.DiskBackend` and
implements :class:`lmcache_core.maintenance.MaintainableBackend`. Scans walk the files (the
truth) one shard directory per I/O job and take last-access times from the shared index;
headers are read only when asked for.

These methods report problems, they do not crash on them: a damaged index met here is
rebuilt (:mod:`.recovery`) and the call retried once; if the index still cannot be used,
a :class:`~lmcache_backend_disk.DiskTierError` says so.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from lmcache_core.errors import ConfigError
from lmcache_core.maintenance import EntryInfo, ProgressCallback

from . import layout
from .index import is_damage
from .state import DiskState

__all__ = ["DiskMaintenance"]

log = logging.getLogger("lmcache_core.disk")
T = TypeVar("T")
#: Largest ``namespace.json`` read (it holds one namespace's JSON).
_MARKER_LIMIT = 1 << 20
#: Longest wait for a rebuild in progress before a maintenance call gives up.
_HEAL_WAIT_S = 600.0


class DiskMaintenance(DiskState):
    """Scan / verify / delete / reconcile for the disk backend (a mixin)."""

    @classmethod
    def open_for_maintenance(cls, path: str) -> Any:
        """An unstarted backend on the disk tier in directory ``path``, for ``lmcache-core
        verify/gc/inspect --path`` (:class:`lmcache_core.interface.OpensForMaintenance`).

        Raises :class:`~lmcache_core.errors.ConfigError` when ``path`` holds no disk tier:
        nothing is created there. No size bound applies (maintenance never evicts).
        """
        root = Path(path)
        if not (root / layout.META_DIR).is_dir():
            raise ConfigError(f"{root} is not a disk tier (no {layout.META_DIR} directory in it)")
        factory: Any = cls
        return factory({"path": str(root), "max_bytes": 1 << 62}, name="disk")

    def _with_index(self, fn: Callable[[], T]) -> T:
        """``fn()``; if it meets a damaged or unavailable index, wait for the rebuild and
        retry once. Raises :class:`DiskTierError` when the index stays unusable."""
        from .backend import DiskTierError

        try:
            return fn()
        except sqlite3.Error as exc:
            if not (is_damage(exc) or self.index.unavailable is not None):
                raise DiskTierError(f"disk tier {self.root}: index error: {exc}") from exc
            log.warning("disk tier %s: %s; waiting for the index rebuild", self.root, exc)
        if not self._wait_healed(_HEAL_WAIT_S):
            raise DiskTierError(
                f"disk tier {self.root}: the index is unusable ({self.index.unavailable})"
            )
        try:
            return fn()
        except sqlite3.Error as exc:
            raise DiskTierError(f"disk tier {self.root}: index error: {exc}") from exc

    # ------------------------------------------------------------------ scan
    async def scan(
        self, *, read_headers: bool = False, progress: ProgressCallback | None = None
    ) -> AsyncIterator[EntryInfo]:
        """Every object file (key and namespace from its header when ``read_headers``;
        ``None`` for an unreadable header). ``progress(done, total)`` follows the walk;
        ``total`` is the index's entry count. Without a usable index, the last access
        times are the files' modification times."""
        self._check()
        atimes = await self._call(self._atimes_sync)
        total = len(atimes)
        tops = await self._call(self._scan_tops_sync)
        done = 0
        if progress is not None:
            progress(0, total)
        for top in tops:
            infos = await self._call(self._scan_top_sync, top, atimes, read_headers)
            for info in infos:
                yield info
            done += len(infos)
            if progress is not None and infos:
                progress(done, max(total, done))

    def _atimes_sync(self) -> dict[str, float]:
        def read() -> dict[str, float]:
            with self.index.snapshot() as tx:
                return tx.atimes()

        try:
            return self._with_index(read)
        except Exception as exc:  # the scan walks the files anyway
            log.warning("disk tier %s: no access times from the index: %s", self.root, exc)
            return {}

    def _scan_tops_sync(self) -> list[str]:
        return [
            s for ns in layout.namespace_dirs(self.tier) for s in layout.shard_dirs(self.tier, ns)
        ]

    def _scan_top_sync(
        self, top: str, atimes: dict[str, float], read_headers: bool
    ) -> list[EntryInfo]:
        out = []
        for f in layout.iter_files(self.tier, top):
            if not isinstance(f, layout.ObjectFile):
                continue
            key = namespace = None
            if read_headers:
                header = self.io.read_header(f.rel)
                if header is not None:
                    key, namespace = header.key, header.namespace
            out.append(
                EntryInfo(
                    location=f.rel,
                    size=f.size,
                    last_access=atimes.get(f.rel, f.mtime),
                    key=key,
                    namespace=namespace,
                )
            )
        return out

    # ------------------------------------------------------------------ verify / delete
    async def check_entry(self, entry: EntryInfo) -> str | None:
        """Read the object fully; ``None`` when sound, else why not (including an object
        stored at another key's or namespace's location, or a symbolic link)."""
        self._check()
        if not layout.is_object_relpath(entry.location):
            return "not an object location of this tier"
        return await self._call(self.io.verify, entry.location)

    async def verify_entry(self, entry: EntryInfo) -> bool:
        """Read the object fully and check size, header, location and checksum."""
        return await self.check_entry(entry) is None

    async def delete_entry(self, entry: EntryInfo) -> bool:
        """Delete one object (and its index row); ``True`` when a file was deleted."""
        self._check()
        return await self._call(self._remove_rel_sync, entry.location)

    # ------------------------------------------------------------------ tier-wide
    async def namespaces(self) -> dict[str, str | None]:
        """Namespace JSON of each namespace directory (``None`` when its marker is gone)."""
        self._check()
        return await self._call(self._namespaces_sync)

    def _namespaces_sync(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for ns in layout.namespace_dirs(self.tier):
            try:
                raw = self.tier.read_file(f"{ns}/{layout.NAMESPACE_FILE}", _MARKER_LIMIT)
                value = json.loads(raw.decode("utf-8")).get("namespace")
                out[ns] = value if isinstance(value, str) else None
            except (OSError, ValueError, AttributeError):
                out[ns] = None
        return out

    async def usage(self) -> dict[str, Any]:
        """Bytes used (objects + writes in progress), entries, and the recorded bound."""
        self._check()
        return await self._call(self._with_index, self._usage_sync)

    def _usage_sync(self) -> dict[str, Any]:
        with self.index.snapshot() as tx:
            used, entries = tx.totals()
            max_bytes = tx.meta("max_bytes")
        bound = int(max_bytes) if max_bytes is not None and max_bytes.isdigit() else None
        return {"used_bytes": used, "entries": entries, "max_bytes": bound}

    async def reconcile(self) -> dict[str, int]:
        """Make the index agree with the files: check its integrity (a damaged index is
        rebuilt), settle dead writers, remove stale temporary files, drop rows that fail
        validation, adopt objects the index lacks, drop rows whose file is gone, and
        recompute the totals."""
        self._check()
        return await self._call(self._with_index, self._reconcile_sync)

    def _reconcile_sync(self) -> dict[str, int]:
        with self.index.snapshot() as tx:
            tx.integrity_check()  # damage: rebuilt (and this call retried once)
        reaped = self._reap_sync()
        stale_before = time.time() - self.opts.stale_temp_seconds
        with self.index.transaction() as tx:
            invalid = tx.sanitize()
        with self.index.snapshot() as tx:
            live_tmps = tx.pending_tmp_names()
        temps = 0
        for ns in layout.namespace_dirs(self.tier):
            for f in layout.iter_files(self.tier, ns):
                if (
                    isinstance(f, layout.TempFile)
                    and f.rel not in live_tmps
                    and self._temp_is_stale(f, stale_before)
                    and self.tier.unlink(f.rel)
                ):
                    temps += 1
        adopted, dropped = self._sync_rows_with_files()
        return {
            "reaped_owners": reaped,
            "removed_temps": temps,
            "adopted": adopted,
            "dropped_rows": dropped,
            "invalid_rows": invalid,
        }
