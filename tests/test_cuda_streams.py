"""CUDA tensors handed to tiers follow the caller's stream (``lmcache_core.cuda_sync``).

A value still being computed on the caller's (non-default) stream when it is stored is
stored as computed; a buffer the caller's stream still writes when a load is asked for
is filled after that write. Checked for the cpu tier, a byte-store tier (the template
backend: objects decode into host memory, then reach the device), the hierarchy with a
write-through, and the blocking ``SyncBackend`` (whose IO thread has a stream of its
own). The CUDA tests need a GPU (``tools/gpu_check.sh`` runs this file there); the
decode guard below runs everywhere.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_core import TieredHierarchy
from lmcache_core.blob import decode_object, encode_object
from lmcache_core.errors import BufferMismatchError
from lmcache_core.keys import CacheEngineKey
from lmcache_core.sync import SyncBackend


def cuda(fn: Any) -> Any:
    """A test of the CUDA paths: skipped with the reason where there is no GPU."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
    return pytest.mark.gpu(skip(fn))


N = 4 << 20


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("streams", 1, 0, 1000 + i, "uint8")


def test_objects_never_decode_into_device_memory_directly() -> None:
    """The byte-store decoder copies with memmove and hashes in place: a device ``out``
    is refused before any byte moves (a memmove to a device address would crash)."""
    key = _key(0)
    data = bytes(encode_object(key, None, torch.arange(64, dtype=torch.uint8)))
    out = torch.empty(64, dtype=torch.uint8, device="meta")
    with pytest.raises(BufferMismatchError, match="host memory"):
        decode_object(data, key, None, out)


def _busy_then(stream: Any, t: torch.Tensor, value: int) -> None:
    """On ``stream``: tens of milliseconds of matrix products, then ``t.fill_(value)``."""
    with torch.cuda.stream(stream):
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(8):
            a = a @ a.T / 4096
        t.fill_(value)


async def _round_trip(backend: Any, i: int) -> None:
    side = torch.cuda.Stream()
    v = torch.zeros(N, dtype=torch.uint8, device="cuda")
    _busy_then(side, v, 7)
    with torch.cuda.stream(side):
        assert await backend.put(_key(i), v)
        out = torch.zeros(N, dtype=torch.uint8, device="cuda")
        _busy_then(side, out, 1)  # the caller's last write to the buffer
        assert await backend.get_into(_key(i), out)
    torch.cuda.synchronize()
    assert bool((out == 7).all()), "a store or load ran before the caller's stream"


def _cpu_tier() -> Any:
    from lmcache_core.backends.cpu import CPUBackend

    return CPUBackend({"max_bytes": 64 << 20})


async def _started_round_trip(backend: Any, i: int) -> None:
    await backend.start()
    try:
        await _round_trip(backend, i)
    finally:
        await backend.close()


@cuda
def test_cpu_tier_follows_the_callers_stream() -> None:
    asyncio.run(_started_round_trip(_cpu_tier(), 1))


@cuda
def test_byte_store_tier_loads_into_device_buffers(tmp_path: Path) -> None:
    from lmcache_backend_template import TemplateBackend  # (pyproject: on pytest's path)

    asyncio.run(_started_round_trip(TemplateBackend({"path": str(tmp_path)}), 2))


@cuda
def test_hierarchy_write_through_of_a_device_value(tmp_path: Path) -> None:
    """The value is copied to the host once, after the caller's stream: the disk tier's
    background store reads that copy, never the device tensor later."""
    cfg = {
        "tiers": [
            {"name": "cpu", "backend": "cpu", "options": {"max_bytes": 64 << 20}},
            {"name": "disk", "backend": "disk", "options": {"path": str(tmp_path / "d")}},
        ]
    }

    async def body() -> None:
        h = TieredHierarchy.from_config(cfg)
        await h.start()
        try:
            await _round_trip(h, 3)
            await h.flush()
            disk = h.tiers[1].backend
            got = await disk.get(_key(3))
            assert got is not None and bool((got == 7).all())
        finally:
            await h.close()

    asyncio.run(body())


@cuda
def test_sync_backend_settles_the_callers_stream() -> None:
    """A blocking call runs the tier on the IO thread, whose current stream is another:
    the caller's stream is waited for in the calling thread first."""
    with SyncBackend(_cpu_tier()) as b:
        side = torch.cuda.Stream()
        v = torch.zeros(N, dtype=torch.uint8, device="cuda")
        _busy_then(side, v, 9)
        with torch.cuda.stream(side):
            assert b.put(_key(4), v)
            out = torch.zeros(N, dtype=torch.uint8, device="cuda")
            _busy_then(side, out, 1)
            assert b.get_into(_key(4), out)
        torch.cuda.synchronize()
        assert bool((out == 9).all())
