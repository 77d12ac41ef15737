"""Helpers shared by the disk backend's tests."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from lmcache_backend_disk import DiskBackend

    from lmcache_core import CacheEngineKey

T = TypeVar("T")
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "disk_fault_worker.py")


def run(coro: Coroutine[Any, Any, T], timeout: float = 300.0) -> T:
    """Run a coroutine to completion (tests are synchronous)."""

    async def guarded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(guarded())


def start_worker(*args: Any) -> subprocess.Popen[str]:
    """Start ``disk_fault_worker.py`` with ``args`` (stdout captured)."""
    return subprocess.Popen(
        [sys.executable, WORKER, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish_worker(proc: subprocess.Popen[str], timeout: float = 300.0) -> dict[str, Any]:
    """Wait for a worker and parse its JSON report (failing with its stderr)."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{err[-4000:]}"
    return dict(json.loads(out.strip().splitlines()[-1]))


def tree_files(root: str) -> list[tuple[str, int]]:
    """(relative path, size) of every regular file under the namespace directories."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir.startswith(".lmcache-disk"):
            continue
        for f in files:
            try:
                size = os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                continue
            out.append((os.path.join(rel_dir, f), size))
    return out


def object_files(root: str) -> dict[str, int]:
    """Object files (32-hex names) under ``root`` -> size."""
    return {
        rel: size
        for rel, size in tree_files(root)
        if len(os.path.basename(rel)) == 32 and not rel.endswith(".tmp")
    }


def temp_files(root: str) -> list[str]:
    return [rel for rel, _ in tree_files(root) if rel.endswith(".tmp")]


def object_bytes(key: CacheEngineKey, ns_json: str, data: bytes, dtype: Any, shape: Any) -> bytes:
    """The complete object file the disk backend writes for ``data`` (a raw value's bytes)
    under ``key``: its own header encoder, checksum digits filled in."""
    from lmcache_backend_disk.objects import HeaderTemplate
    from xxhash import xxh3_128_hexdigest

    template = HeaderTemplate(key.to_string(), ns_json, dtype, tuple(shape), "raw")
    return template.with_digits(xxh3_128_hexdigest(data)) + data


def bulk_fill(
    b: DiskBackend,
    keys: Sequence[CacheEngineKey],
    value_bytes: Callable[[int], bytes],
    dtype: Any,
    shape: Any,
) -> None:
    """Store ``keys[i]`` -> ``value_bytes(i)`` in the open backend ``b`` without its put
    path: a test helper for tests whose subject is a *big* tier (reopening it), not how it
    was filled. A put costs about a millisecond of Python and thread hand-offs on a small
    machine; this writes each object file directly (the bytes :func:`object_bytes` makes,
    through the backend's own tier directory: its ``make_dirs`` and ``open``, with the
    backend's file and directory modes) and records every entry in one index transaction
    through the backend's own :class:`IndexTx` (its triggers keep the totals and the
    change log, pruned like a writer prunes it).

    Callers store some entries through the real put path first and check
    :func:`object_bytes` against those files, so this helper cannot drift from the format
    unnoticed. ``b`` must be the only process using its directory; no eviction is done
    (the bound must hold everything)."""
    from lmcache_backend_disk import layout

    tier = b.tier
    ns_json = layout.namespace_json(b.namespace)
    ns_dir = b._ns_dir
    umask = layout.current_umask()
    made: set[str] = set()
    rows = []
    for i, key in enumerate(keys):
        rel = layout.object_relpath(ns_dir, key)
        head = rel.rpartition("/")[0]
        if head not in made:
            tier.make_dirs(head, b.dir_mode, umask)
            made.add(head)
        blob = object_bytes(key, ns_json, value_bytes(i), dtype, shape)
        fd = tier.open(rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, b.file_mode)
        try:
            if b.file_mode & umask:
                os.fchmod(fd, b.file_mode)
            assert os.write(fd, blob) == len(blob)
        finally:
            os.close(fd)
        rows.append((rel, len(blob)))
    now = time.time()
    with b.index.transaction() as tx:
        for rel, size in rows:
            tx.upsert_entry(rel, size, now)
        tx.prune_changes()


def record_takes(b: Any) -> list[int]:
    """Sizes of every staging buffer the disk backend ``b`` takes from now on (appended
    as it takes them)."""
    taken: list[int] = []
    real_take = b._buffers.take

    def take(nbytes: int) -> Any:
        taken.append(nbytes)
        return real_take(nbytes)

    b._buffers.take = take
    return taken
