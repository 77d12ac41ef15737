"""With a single ``path`` a gds tier IS a disk tier: the two backends, open on one
directory at the same time, read what the other wrote, share one bound and one index."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import torch
from gds_testutil import object_path
from lmcache_backend_disk import DiskBackend, aligned_empty
from lmcache_backend_gds import GdsBackend

from lmcache_core.keys import Namespace
from lmcache_core.testing.contract import make_key, random_tensor, same_bits

NS = Namespace(model_name="interop", chunk_size=256)


def test_gds_and_disk_open_on_one_directory_read_each_other(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")

    async def body() -> None:
        gds = GdsBackend({"path": root, "max_bytes": "64MiB"}, namespace=NS)
        disk = DiskBackend({"path": root, "max_bytes": "64MiB"}, namespace=NS)
        await gds.start()
        await disk.start()
        try:
            assert gds.stats()["io_path"] == "posix"  # no CUDA driver on this machine
            by_gds = [make_key(f"g{i}") for i in range(6)]
            by_disk = [make_key(f"d{i}") for i in range(6)]
            vg = [random_tensor((3, 4096 + i * 1000), torch.bfloat16, seed=i) for i in range(6)]
            vd = [random_tensor((5, 777 * (i + 1)), torch.float16, seed=50 + i) for i in range(6)]
            # aligned and plain values, single and batched puts, from both sides
            assert await gds.put(by_gds[0], vg[0])
            assert await gds.batched_put(by_gds[1:], vg[1:]) == [True] * 5
            assert await disk.put(by_disk[0], vd[0])
            assert await disk.batched_put(by_disk[1:], vd[1:]) == [True] * 5
            # each reads the other's (get, get_into into plain and aligned buffers, batched)
            for k, v in zip(by_gds, vg, strict=True):
                assert same_bits(await disk.get(k), v)
                out = aligned_empty(v.shape, v.dtype)
                assert await disk.get_into(k, out) and same_bits(out, v)
            for k, v in zip(by_disk, vd, strict=True):
                assert same_bits(await gds.get(k), v)
                out = torch.empty_like(v)
                assert await gds.get_into(k, out) and same_bits(out, v)
            outs = [aligned_empty(v.shape, v.dtype) for v in vd]
            assert await gds.batched_get_into(by_disk, outs) == [True] * 6
            assert all(same_bits(o, v) for o, v in zip(outs, vd, strict=True))
            assert await disk.batched_contains(by_gds) == [True] * 6
            # the same file, where the disk tier puts it
            assert os.path.isfile(object_path(gds, by_gds[0]))
            assert object_path(gds, by_disk[0]) == os.path.join(root, disk._rel(by_disk[0]))
            # one index: both see all 12 entries; removal by one is seen by the other
            assert (await gds.usage())["entries"] == (await disk.usage())["entries"] == 12
            assert await disk.remove(by_gds[2])
            assert await gds.get(by_gds[2]) is None
            assert await gds.remove(by_disk[3])
            assert await disk.get(by_disk[3]) is None
            # the disk tier's maintenance verifies what gds wrote
            checked = 0
            async for e in disk.scan():
                assert await disk.check_entry(e) is None, e.location
                checked += 1
            assert checked == 10
        finally:
            await asyncio.gather(gds.close(), disk.close())

    asyncio.run(body())


def test_concurrent_writes_of_one_key_by_both_backends(tmp_path: Path) -> None:
    """Both backends hammer the same keys at once: every read by either is bit-exact to
    one of the two values (never a mix)."""
    root = str(tmp_path / "tier")

    async def body() -> None:
        gds = GdsBackend({"path": root, "max_bytes": "64MiB"})
        disk = DiskBackend({"path": root, "max_bytes": "64MiB"})
        await gds.start()
        await disk.start()
        try:
            keys = [make_key(f"race{i}") for i in range(4)]
            a = [random_tensor((256 * 1024,), torch.uint8, seed=i) for i in range(4)]
            b = [random_tensor((256 * 1024,), torch.uint8, seed=100 + i) for i in range(4)]
            for _ in range(5):
                results = await asyncio.gather(
                    gds.batched_put(keys, a), disk.batched_put(keys, b), gds.batched_get(keys)
                )
                for got, va, vb in zip(results[2], a, b, strict=True):
                    assert got is None or same_bits(got, va) or same_bits(got, vb)
            for k, va, vb in zip(keys, a, b, strict=True):
                for backend in (gds, disk):
                    got = await backend.get(k)
                    assert same_bits(got, va) or same_bits(got, vb)
        finally:
            await asyncio.gather(gds.close(), disk.close())

    asyncio.run(body())
