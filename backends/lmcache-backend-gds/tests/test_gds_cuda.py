"""Device paths of the gds backend: CUDA tensors to files and back, through kvikio's
CuFile (GDS or compatibility mode) and through the host-staged POSIX path.

These need an NVIDIA GPU (``tools/gpu_check.sh`` runs them); without one they are skipped
with the reason. Everything here is bit-exact or a miss."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from gds_testutil import corrupt_file, object_path
from lmcache_backend_disk import DiskBackend
from lmcache_backend_gds import GdsBackend, runtime
from xxhash import xxh3_128_hexdigest

from lmcache_core import format as fmt
from lmcache_core.testing.contract import make_key, random_tensor, same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs an NVIDIA GPU with a CUDA build of torch (run tools/gpu_check.sh there)",
    ),
]


def _kvikio_works() -> bool:
    try:
        runtime.import_kvikio()
    except ImportError:
        return False
    return True


@pytest.fixture(params=["kvikio", "posix"])
def backend_opts(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, object]:
    if request.param == "kvikio" and not _kvikio_works():
        pytest.skip(
            "kvikio is not installed: pip install './backends/lmcache-backend-gds[kvikio]' (in an lmcache-core checkout)"
        )
    return {
        "path": str(tmp_path / "tier"),
        "max_bytes": "1GiB",
        "force_posix": request.param == "posix",
    }


def test_device_tensors_round_trip_bit_exact(backend_opts: dict[str, object]) -> None:
    async def body() -> None:
        b = GdsBackend(backend_opts)
        await b.start()
        try:
            if not backend_opts["force_posix"]:
                assert b.stats()["io_path"] in ("gds", "compat"), b.stats()["io_path_reason"]
            cases = [
                (torch.bfloat16, (2, 8, 128, 256)),  # 1 MiB, aligned
                (torch.float16, (3, 3001)),  # a partial last block
                (torch.uint8, (5 << 20,)),  # more than one kvikio task
                (torch.float32, (0,)),
            ]
            for i, (dtype, shape) in enumerate(cases):
                key = make_key(f"dev{i}")
                host = random_tensor(shape, dtype, seed=i)
                dev = host.cuda()
                assert await b.put(key, dev)
                out = torch.empty(shape, dtype=dtype, device="cuda")
                assert await b.get_into(key, out)
                assert same_bits(out.cpu(), host)
                assert same_bits(await b.get(key), host)  # get returns host memory
                outs = [torch.empty_like(dev)]
                assert await b.batched_get_into([key], outs) == [True]
                assert same_bits(outs[0].cpu(), host)
        finally:
            await b.close()

    asyncio.run(body())


def test_device_written_objects_carry_the_host_checksum(backend_opts: dict[str, object]) -> None:
    """The checksum written for a device value equals xxh3-128 of its bytes on the host,
    and a disk backend (host only) reads the object bit-exactly."""

    async def body() -> None:
        b = GdsBackend(backend_opts)
        await b.start()
        disk = DiskBackend({"path": backend_opts["path"], "max_bytes": "1GiB"})
        await disk.start()
        try:
            key = make_key("sum")
            host = random_tensor((4, 4096), torch.float16, seed=7)
            assert await b.put(key, host.cuda())
            with open(object_path(b, key), "rb") as f:
                raw = f.read()
            header = fmt.decode_header(raw, total_size=len(raw))
            assert header.checksum == "xxh3_128:" + xxh3_128_hexdigest(fmt.tensor_bytes(host))
            assert same_bits(await disk.get(key), host)
        finally:
            await asyncio.gather(b.close(), disk.close())

    asyncio.run(body())


@pytest.mark.parametrize("kind", ["flip", "truncate", "foreign"])
def test_damaged_objects_are_device_misses(backend_opts: dict[str, object], kind: str) -> None:
    async def body() -> None:
        b = GdsBackend(backend_opts)
        await b.start()
        try:
            key = make_key(f"bad-{kind}")
            host = random_tensor((8192,), torch.float16, seed=11)
            assert await b.put(key, host.cuda())
            corrupt_file(object_path(b, key), kind, key)
            out = torch.empty(8192, dtype=torch.float16, device="cuda")
            assert await b.get_into(key, out) is False
            assert not os.path.exists(object_path(b, key))
            assert b.stats()["bad_objects"] == 1
        finally:
            await b.close()

    asyncio.run(body())


def test_values_and_buffers_follow_the_callers_stream(backend_opts: dict[str, object]) -> None:
    """A value still being made on the caller's (non-default) stream when ``put`` is
    called is written as made, and a buffer the caller's stream still writes when
    ``get_into`` is called is filled after that write: the tier waits for an event
    recorded on the caller's current stream, not for the default stream."""

    async def body() -> None:
        b = GdsBackend(backend_opts)
        await b.start()
        try:
            side = torch.cuda.Stream()
            n = 8 << 20
            with torch.cuda.stream(side):
                a = torch.randn(4096, 4096, device="cuda")
                for _ in range(8):
                    a = a @ a.T / 4096  # keep the caller's stream busy
                v = torch.zeros(n, dtype=torch.uint8, device="cuda")
                v.fill_(7)  # queued behind the products
                assert await b.put(make_key("stream"), v)
                out = torch.zeros(n, dtype=torch.uint8, device="cuda")
                for _ in range(8):
                    a = a @ a.T / 4096
                out.fill_(1)  # the caller's last write to the buffer, queued before the read
                assert await b.get_into(make_key("stream"), out)
            torch.cuda.synchronize()
            assert bool((out == 7).all()), "the tier read or wrote before the caller's stream"
        finally:
            await b.close()

    asyncio.run(body())
