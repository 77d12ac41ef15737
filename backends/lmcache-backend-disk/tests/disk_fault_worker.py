"""Subprocess side of the disk tier's fault and multi-process tests.

Run as a script (``python disk_fault_worker.py MODE ...``); prints one JSON line when done.

``killloop DIR ROUNDS SEED``
    A zygote: imports torch and the backend once, then ROUNDS times forks a writer, lets it
    run for a random 0-0.3 s and SIGKILLs it (sometimes two writers at once). Reports the
    temporary files each killed writer left behind.
``writer DIR SECONDS MAX_BYTES CHUNK SEED``
    Stores CHUNK-byte values under keys 0..KEYS-1 (random versions) for SECONDS.
``reader DIR SECONDS CHUNK SEED``
    Reads random keys for SECONDS; every hit must equal one of the key's versions.
``ownerkill DIR``
    Starts a backend that dies (SIGKILL) between creating its owner file under its
    temporary name and renaming it into place.
``pinner DIR TTL FIRST N``
    Pins keys FIRST..FIRST+N-1 (``pin_many``, TTL seconds), prints ``{"pinned": n}``, waits
    for its stdin to close, then unpins them and reports.

Values are deterministic: ``value(i, v, n)`` is a fixed random block rotated by an amount
that depends on key ``i`` and version ``v``, so any process can check any hit bit-exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from typing import Any

import numpy as np
import torch
from lmcache_backend_disk import DiskBackend

from lmcache_core import CacheEngineKey, Namespace

KEYS = 48
VERSIONS = 3
NAMESPACE = Namespace(model_name="disk-fault-test")
_BASE = np.frombuffer(np.random.default_rng(1234).bytes(40 << 20), dtype=np.uint8)


def key_of(i: int) -> CacheEngineKey:
    return CacheEngineKey("disk-fault-test", 1, 0, i + 1, "uint8")


def value(i: int, v: int, nbytes: int) -> torch.Tensor:
    """The deterministic value of key ``i``, version ``v``."""
    return torch.from_numpy(np.roll(_BASE[:nbytes], 7919 * i + 104729 * v + 1))


def size_of(i: int) -> int:
    """Value size of key ``i`` in the kill test: 4 KiB .. 2 MiB, some not 4 KiB multiples."""
    return [4096, 65536 + 123, 1 << 20, 2 << 20, 300_000][i % 5]


def matches_some_version(i: int, got: torch.Tensor, nbytes: int) -> bool:
    flat = got.reshape(-1).view(torch.uint8)
    return any(torch.equal(flat, value(i, v, nbytes)) for v in range(VERSIONS))


def backend(path: str, max_bytes: int, **extra: Any) -> DiskBackend:
    return DiskBackend({"path": path, "max_bytes": max_bytes, **extra}, namespace=NAMESPACE)


# --------------------------------------------------------------------------- kill loop
async def _kill_writer(path: str, seed: int) -> None:
    rnd = random.Random(seed)
    b = backend(path, 24 << 20)
    await b.start()
    while True:
        idx = [rnd.randrange(KEYS) for _ in range(rnd.choice((1, 1, 3, 6)))]
        vals = [value(i, rnd.randrange(VERSIONS), size_of(i)) for i in idx]
        if len(idx) == 1:
            await b.put(key_of(idx[0]), vals[0])
        else:
            await b.batched_put([key_of(i) for i in idx], vals)
        if rnd.random() < 0.2:
            await b.remove(key_of(rnd.randrange(KEYS)))


def _count_temps(path: str) -> int:
    n = 0
    for _dirpath, _dirs, files in os.walk(path):
        n += sum(1 for f in files if f.endswith(".tmp"))
    return n


def kill_loop(path: str, rounds: int, seed: int) -> dict[str, Any]:
    rnd = random.Random(seed)
    left_temps = 0
    kills = 0
    for r in range(rounds):
        pids = []
        for j in range(2 if r % 5 == 4 else 1):  # every fifth round: two writers at once
            pid = os.fork()
            if pid == 0:  # child: write until killed
                try:
                    asyncio.run(_kill_writer(path, seed * 1000 + r * 10 + j))
                finally:
                    os._exit(1)
            pids.append(pid)
        time.sleep(rnd.uniform(0.0, 0.3))
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            kills += int(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL)
        left_temps += _count_temps(path)
    return {"kills": kills, "left_temps": left_temps}


def owner_kill(path: str) -> None:
    real_rename = os.rename

    def rename(src: Any, dst: Any, **kwargs: Any) -> None:
        if str(src).endswith(".new"):
            os.kill(os.getpid(), signal.SIGKILL)
        real_rename(src, dst, **kwargs)

    os.rename = rename  # type: ignore[assignment]
    asyncio.run(backend(path, 1 << 30).start())


# --------------------------------------------------------------------------- soak
async def writer(
    path: str, seconds: float, max_bytes: int, chunk: int, seed: int
) -> dict[str, Any]:
    rnd = random.Random(seed)
    b = backend(path, max_bytes)
    await b.start()
    stored = rejected = 0
    t_end = time.monotonic() + seconds
    try:
        while time.monotonic() < t_end:
            idx = rnd.sample(range(KEYS), rnd.choice((1, 2, 4)))
            vals = [value(i, rnd.randrange(VERSIONS), chunk) for i in idx]
            res = await b.batched_put([key_of(i) for i in idx], vals)
            stored += sum(res)
            rejected += len(res) - sum(res)
            await asyncio.sleep(rnd.uniform(0.0, 0.03))
        return {"stored": stored, "rejected": rejected, "stats": b.stats()}
    finally:
        await b.close()


async def reader(path: str, seconds: float, chunk: int, seed: int) -> dict[str, Any]:
    rnd = random.Random(seed)
    b = backend(path, 1 << 40)
    await b.start()
    hits = misses = bad = 0
    out = torch.empty(chunk, dtype=torch.uint8)
    t_end = time.monotonic() + seconds
    try:
        while time.monotonic() < t_end:
            i = rnd.randrange(KEYS)
            if rnd.random() < 0.5:
                got: torch.Tensor | None = out if await b.get_into(key_of(i), out) else None
            else:
                got = await b.get(key_of(i))
            if got is None:
                misses += 1
            elif matches_some_version(i, got, chunk):
                hits += 1
            else:
                bad += 1
        return {"hits": hits, "misses": misses, "bad": bad, "stats": b.stats()}
    finally:
        await b.close()


async def pinner(path: str, ttl: float, first: int, n: int) -> dict[str, Any]:
    b = backend(path, 1 << 40)
    await b.start()
    try:
        handles = b.pin_many([key_of(first + i) for i in range(n)], ttl_s=ttl)
        pinned = sum(h is not None for h in handles)
        print(json.dumps({"pinned": pinned}), flush=True)
        await asyncio.to_thread(sys.stdin.read)
        b.unpin_many([h for h in handles if h is not None])
        return {"pinned": pinned, "stats": b.stats()}
    finally:
        await b.close()


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "killloop":
        result = kill_loop(argv[1], int(argv[2]), int(argv[3]))
    elif mode == "ownerkill":
        owner_kill(argv[1])
        raise SystemExit("ownerkill: the backend started without renaming an owner file")
    elif mode == "writer":
        result = asyncio.run(
            writer(argv[1], float(argv[2]), int(argv[3]), int(argv[4]), int(argv[5]))
        )
    elif mode == "reader":
        result = asyncio.run(reader(argv[1], float(argv[2]), int(argv[3]), int(argv[4])))
    elif mode == "pinner":
        result = asyncio.run(pinner(argv[1], float(argv[2]), int(argv[3]), int(argv[4])))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
