"""Live statistics of the tiered hierarchy: latency percentiles, per-tier counters, files.

* :class:`LatencyReservoir` keeps the most recent ``capacity`` samples of one latency
  (a ring buffer, so memory is bounded and the percentiles follow the current load).
* :class:`TierStats` holds one tier's counters and latencies.
* :class:`StatsFileWriter` writes a JSON snapshot to ``<stats_dir>/<pid>.json`` every few
  seconds (written to a temporary file, then renamed: a reader never sees half a file);
  :func:`read_stats_dir` reads them back for ``lmcache-core inspect``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..redaction import scrub

__all__ = [
    "LatencyReservoir",
    "StatsFileWriter",
    "TierStats",
    "pid_alive",
    "read_stats_dir",
    "write_json_atomic",
]

log = logging.getLogger("lmcache_core.stats")

#: Version of the stats file layout (bumped when fields are renamed or removed).
STATS_FILE_VERSION = 1


class LatencyReservoir:
    """The last ``capacity`` latency samples (seconds) and their percentiles."""

    __slots__ = ("_count", "_pos", "_samples", "capacity")

    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._samples: list[float] = []
        self._pos = 0
        self._count = 0

    def add(self, seconds: float) -> None:
        """Record one sample (the oldest is forgotten once ``capacity`` are held)."""
        self._count += 1
        if len(self._samples) < self.capacity:
            self._samples.append(seconds)
        else:
            self._samples[self._pos] = seconds
            self._pos = (self._pos + 1) % self.capacity

    @property
    def count(self) -> int:
        """Samples recorded since creation (not only those held)."""
        return self._count

    def percentiles(self, qs: tuple[float, ...] = (50.0, 90.0, 99.0)) -> dict[str, float | None]:
        """``{"p50_ms": ..., "p90_ms": ..., "p99_ms": ...}`` (nearest rank; ``None`` if empty)."""
        data = sorted(self._samples)
        out: dict[str, float | None] = {}
        for q in qs:
            name = f"p{q:g}_ms"
            if not data:
                out[name] = None
                continue
            rank = max(1, math.ceil(q / 100.0 * len(data)))
            out[name] = round(data[rank - 1] * 1000.0, 4)
        return out

    def as_dict(self) -> dict[str, Any]:
        """Count plus p50/p90/p99 in milliseconds."""
        d: dict[str, Any] = {"count": self._count}
        d.update(self.percentiles())
        return d


@dataclass
class TierStats:
    """Counters of one tier as the hierarchy sees it (the backend keeps its own too).

    ``bytes_out`` are bytes loaded *from* the tier, ``bytes_in`` bytes stored *into* it.
    ``dropped_stores`` counts stores shed by backpressure or while the tier was failing
    (``dropped_by_reason`` splits it); ``errors`` counts exceptions the tier raised;
    ``timeouts`` loads and lookups that missed their deadline.
    """

    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    stores: int = 0
    store_failures: int = 0
    lookups: int = 0
    lookup_keys: int = 0
    lookup_found: int = 0
    promotions: int = 0
    write_backs: int = 0
    known_skips: int = 0
    not_admitted: int = 0
    coalesced_stores: int = 0
    dropped_stores: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    timeouts: int = 0
    skipped: int = 0
    pins: int = 0
    load_latency: LatencyReservoir = field(default_factory=LatencyReservoir)
    lookup_latency: LatencyReservoir = field(default_factory=LatencyReservoir)
    store_latency: LatencyReservoir = field(default_factory=LatencyReservoir)
    queue_wait: LatencyReservoir = field(default_factory=LatencyReservoir)

    def drop(self, reason: str, n: int = 1) -> None:
        """Count ``n`` stores dropped for ``reason`` (``queue_full``, ``queue_latency``, ...)."""
        self.dropped_stores += n
        self.dropped_by_reason[reason] = self.dropped_by_reason.get(reason, 0) + n

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly snapshot."""
        out: dict[str, Any] = {}
        for name, value in self.__dict__.items():
            if isinstance(value, LatencyReservoir):
                out[name] = value.as_dict()
            elif isinstance(value, dict):
                out[name] = dict(value)
            else:
                out[name] = value
        return out


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename.

    The file is readable by its owner only (statistics name paths and hosts), secrets of
    loaded configurations are scrubbed from it (:func:`lmcache_core.redaction.scrub`),
    and a directory created for it is owner-only too. The temporary file is created
    exclusively and never through a symlink.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = json.dumps(scrub(data), indent=1, sort_keys=True, default=str) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a crash: never write through what is there
    fd = os.open(tmp, _CREATE_FLAGS, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_CREATE_FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


_file_counter = itertools.count()


class StatsFileWriter:
    """Writes ``snapshot()`` to ``<directory>/<pid>.json`` every ``interval_s`` seconds.

    The first writer in a process uses ``<pid>.json``, later ones ``<pid>-<n>.json``.
    ``stop()`` removes the file, also when a write was still running: files that remain belong to
    live engines or to processes that died (``inspect`` tells them apart by the pid).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        interval_s: float,
        snapshot: Callable[[], dict[str, Any]],
    ) -> None:
        self.directory = Path(directory)
        self.interval_s = interval_s
        self._snapshot = snapshot
        n = next(_file_counter)
        pid = os.getpid()
        self.path = self.directory / (f"{pid}.json" if n == 0 else f"{pid}-{n}.json")
        self._task: asyncio.Task[None] | None = None
        self.writes = 0
        self.failures = 0
        self._started_at = time.time()
        # Cancelling the task does not stop a write already running in its worker
        # thread: without this lock and flag such a write could land after stop() removed
        # the file and leave a live-looking file behind.
        self._file_lock = threading.Lock()
        self._closed = False

    def document(self) -> dict[str, Any]:
        """The full file content: identity of the process plus the snapshot."""
        return {
            "version": STATS_FILE_VERSION,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": self._started_at,
            "updated_at": time.time(),
            "interval_s": self.interval_s,
            **self._snapshot(),
        }

    async def write_now(self) -> None:
        """Write one snapshot (in a worker thread: the event loop never waits on the disk)."""
        doc = self.document()
        try:
            if await asyncio.to_thread(self._write_unless_closed, doc):
                self.writes += 1
        except OSError as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("cannot write stats file %s: %s", self.path, exc)

    def _write_unless_closed(self, doc: dict[str, Any]) -> bool:
        with self._file_lock:
            if self._closed:
                return False
            write_json_atomic(self.path, doc)
            return True

    def _close_and_remove(self) -> None:
        with self._file_lock:
            self._closed = True
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)

    async def _run(self) -> None:
        while True:
            await self.write_now()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        """Start the periodic writes on the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop writing and remove the file (also when a write is still in its thread)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await asyncio.to_thread(self._close_and_remove)


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_stats_dir(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every stats file in ``directory``, each with ``file``, ``alive`` and ``age_s`` added.

    Unreadable or malformed files are returned as ``{"file": ..., "error": ...}``.
    """
    out: list[dict[str, Any]] = []
    root = Path(directory)
    if not root.is_dir():
        return out
    host = socket.gethostname()
    for path in sorted(root.glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            out.append({"file": str(path), "error": str(exc)})
            continue
        doc["file"] = str(path)
        pid = doc.get("pid")
        same_host = doc.get("host") == host
        doc["alive"] = (
            bool(isinstance(pid, int) and same_host and pid_alive(pid)) if same_host else None
        )
        updated = doc.get("updated_at")
        doc["age_s"] = (
            round(time.time() - updated, 3) if isinstance(updated, (int, float)) else None
        )
        out.append(doc)
    return out
