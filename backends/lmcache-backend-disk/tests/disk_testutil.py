"""Helpers shared by the disk backend's tests."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

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
