"""Batched reads into plain (unaligned) buffers hand the copy and the checksum of each
staged object to the CPU pool, so that the I/O thread issues its next read at once
(``ObjectIO.read_into_staged``): every object is still verified, a damaged one is a miss
(counted bad and removed), and the batch completes only when every copy is verified."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from disk_testutil import run
from lmcache_backend_disk import DiskBackend
from lmcache_backend_disk import backend as backend_mod

from lmcache_core import CacheEngineKey
from lmcache_core.errors import BufferMismatchError
from lmcache_core.testing import random_tensor, same_bits

NBYTES = 3 * 65536 + 17


def _plain(n: int) -> torch.Tensor:
    """A buffer that is never aligned for ``O_DIRECT`` (one byte into an allocation)."""
    return torch.zeros(n + 1, dtype=torch.uint8)[1:]


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("concurrency", [1, 2, 32])
def test_staged_batch_reads_are_verified_and_damage_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, concurrency: int
) -> None:
    """Sound objects land bit-exact; a flipped data byte (first, middle, last), a flipped
    header byte and a truncated file are each a miss, removed and counted. With
    ``concurrency`` 1 at most one finisher is queued, so the others run in the I/O thread
    (the bound on staging buffers held): both ways must verify."""
    handed: list[bool] = []
    real = backend_mod.DiskBackend._hand_over

    def spy(self: DiskBackend, *args: object) -> bool:
        ok = real(self, *args)  # type: ignore[arg-type]
        handed.append(ok)
        return ok

    monkeypatch.setattr(backend_mod.DiskBackend, "_hand_over", spy)

    async def body() -> None:
        b = DiskBackend(
            {"path": str(tmp_path / "tier"), "fsync": False, "concurrency": concurrency}
        )
        await b.start()
        try:
            if not b.direct_io:
                pytest.skip("this filesystem refuses O_DIRECT: nothing is staged")
            keys = [CacheEngineKey("handoff", 1, 0, i, "uint8") for i in range(10)]
            values = [random_tensor((NBYTES,), torch.uint8, seed=i) for i in range(10)]
            assert all(await b.batched_put(keys, values))
            outs = [_plain(NBYTES) for _ in keys]
            assert all(await b.batched_get_into(keys, outs))
            assert all(same_bits(o, v) for o, v in zip(outs, values, strict=True))
            assert any(handed), "no copy was handed to the CPU pool"
            if concurrency == 1:
                assert not all(handed), "the bound on queued finishers was not applied"

            paths = [os.path.join(b.root, b._rel(k)) for k in keys]
            size = os.path.getsize(paths[0])
            _flip(paths[1], 4096)  # first data byte
            _flip(paths[3], 4096 + NBYTES // 2)
            _flip(paths[5], size - 1)  # last data byte
            _flip(paths[7], 20)  # inside the header's JSON
            os.truncate(paths[9], size - 4096)
            bad = {1, 3, 5, 7, 9}
            outs = [_plain(NBYTES) for _ in keys]
            got = await b.batched_get_into(keys, outs)
            assert got == [i not in bad for i in range(10)]
            for i in range(10):
                if i not in bad:
                    assert same_bits(outs[i], values[i])
                assert os.path.exists(paths[i]) == (i not in bad)
            st = b.stats()
            assert st["bad_objects"] == len(bad) == st["bad_removed"]
            assert b._later_n == 0  # every finisher ran and was counted
        finally:
            await b.close()

    run(body())


def test_staged_batch_read_into_a_wrong_buffer_raises(tmp_path: Path) -> None:
    """A sound object read into a buffer of another size raises BufferMismatchError (as
    a single ``get_into`` does) and is left in place; the batch's other reads are not
    left running: the same keys read fine afterwards."""

    async def body() -> None:
        b = DiskBackend({"path": str(tmp_path / "tier"), "fsync": False})
        await b.start()
        try:
            keys = [CacheEngineKey("handoff", 1, 0, i, "uint8") for i in range(4)]
            values = [random_tensor((NBYTES,), torch.uint8, seed=i) for i in range(4)]
            assert all(await b.batched_put(keys, values))
            outs = [_plain(NBYTES) for _ in keys]
            outs[2] = _plain(NBYTES - 1)
            with pytest.raises(BufferMismatchError):
                await b.batched_get_into(keys, outs)
            outs[2] = _plain(NBYTES)
            assert all(await b.batched_get_into(keys, outs))
            assert all(same_bits(o, v) for o, v in zip(outs, values, strict=True))
            assert b.stats()["bad_objects"] == 0
        finally:
            await b.close()

    run(body())
