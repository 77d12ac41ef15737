"""The attributes and helpers that the disk backend's parts share (for type checking).

:class:`~lmcache_backend_disk.DiskBackend` is assembled from mixins, one job each:
:mod:`.store` (the write path), :mod:`.recovery` (dead writers, index rebuilds),
:mod:`.maint` (scan / verify / delete / reconcile) and :mod:`.backend` (life cycle, reads,
removal). :class:`DiskState` declares what they use from one another.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from lmcache_core.backend import BackendStats
from lmcache_core.keys import CacheEngineKey

if TYPE_CHECKING:
    from .flusher import Flusher
    from .objects import ObjectIO
    from .options import DiskOptions
    from .sandbox import TierDir
    from .shared_index import SharedIndex

__all__ = ["Counters", "DiskState"]

T = TypeVar("T")


class Counters:
    """Backend-specific counters (reported by ``stats()``)."""

    def __init__(self) -> None:
        self.bad_objects = 0  # truncated / corrupted / foreign objects met on read
        self.bad_removed = 0
        self.stale_rows_removed = 0
        self.busy_misses = 0  # read while being evicted
        self.evictions = 0
        self.evicted_bytes = 0
        self.store_failures = 0  # I/O errors while storing (ENOSPC, EIO, ...)
        self.full_rejections = 0  # no room even after evicting everything evictable
        self.index_errors = 0
        self.read_errors = 0
        self.reaped_owners = 0
        self.removed_temps = 0
        self.index_rebuilds = 0  # index rebuilt from the files (start or healing)
        self.index_heals = 0  # damage found at run time (each starts a rebuild)
        self.index_unavailable = 0  # operations refused while the index was rebuilt
        self.links_removed = 0  # symbolic links (or files) removed where the layout has others
        self.remove_failures = 0  # removals refused by the filesystem (read-only, ...)
        self.pins = 0  # pins taken
        self.pin_failures = 0  # pin calls that could not reach the index in time


class DiskState:
    """Declarations only: the state every part of the disk backend may use."""

    root: str
    opts: DiskOptions
    owner: str
    max_bytes: int
    file_mode: int
    dir_mode: int
    counters: Counters
    _stats: BackendStats
    _ns_json: str
    _ns_dir: str
    _ns_ready: bool
    _ns_lock: threading.Lock
    _bound_recorded: bool
    _seq: Any
    _exec: concurrent.futures.ThreadPoolExecutor | None
    _flusher: Flusher
    _totals: tuple[int, int]
    _index: SharedIndex | None
    _last_audit: float
    _last_owner_check: float

    if TYPE_CHECKING:

        @property
        def started(self) -> bool: ...
        @property
        def tier(self) -> TierDir: ...
        @property
        def index(self) -> SharedIndex: ...
        @property
        def io(self) -> ObjectIO: ...
        def _check(self) -> None: ...
        def _abs(self, rel: str) -> str: ...
        def _rel(self, key: CacheEngineKey) -> str: ...
        async def _call(self, fn: Callable[..., T], *args: Any) -> T: ...
        async def _await_all(self, futs: Sequence[concurrent.futures.Future[T]]) -> list[T]: ...
        def _submit_or_run(self, fn: Callable[..., Any], *args: Any) -> None: ...
        def _take_touches(self) -> list[tuple[str, float]]: ...
        def _remove_rel_sync(self, rel: str) -> bool: ...
        def _reap_sync(self) -> int: ...
        def _temp_is_stale(self, f: Any, stale_before: float) -> bool: ...
        def _take_unpins(self) -> list[int]: ...
        def _requeue_unpins(self, ids: list[int]) -> None: ...
        def _wait_healed(self, timeout: float | None = None) -> bool: ...
        def _ensure_owner_file(self) -> None: ...
        def _sync_rows_with_files(self) -> tuple[int, int]: ...
        def _index_lock(self) -> Any: ...
        def _open_index_locked(self, damaged: tuple[int, int] | None = None) -> None: ...
