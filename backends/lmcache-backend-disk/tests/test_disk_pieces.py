"""Reads of objects larger than one read request (``READ_PIECE``): every piece lands in
the caller's buffer (aligned or not) and is checksummed; damage or a truncation in any
piece is a miss."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from disk_testutil import run
from lmcache_backend_disk import DiskBackend, aligned_empty
from lmcache_backend_disk import objects as objects_mod

from lmcache_core import CacheEngineKey
from lmcache_core.testing import random_tensor, same_bits


@pytest.mark.parametrize("nbytes", [9 * 65536 + 123, 4 * 65536, 5])
def test_reads_in_pieces_land_whole_and_are_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nbytes: int
) -> None:
    monkeypatch.setattr(objects_mod, "READ_PIECE", 65536)

    async def body() -> None:
        b = DiskBackend({"path": str(tmp_path / "tier"), "fsync": False})
        await b.start()
        try:
            key = CacheEngineKey("pieces", 1, 0, nbytes, "uint8")
            value = random_tensor((nbytes,), torch.uint8, seed=nbytes)
            assert await b.put(key, value)
            plain = torch.zeros(nbytes + 1, dtype=torch.uint8)[1:]  # never 4 KiB-aligned
            for out in (aligned_empty((nbytes,), torch.uint8), plain):
                assert await b.get_into(key, out) and same_bits(out, value)
            path = os.path.join(b.root, b._rel(key))
            with open(path, "r+b") as f:  # flip a bit in the last piece
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 1]))
            assert not await b.get_into(key, aligned_empty((nbytes,), torch.uint8))
            assert b.stats()["bad_objects"] == 1
        finally:
            await b.close()

    run(body())


@pytest.mark.parametrize("nbytes", [9 * 65536 + 123, 4 * 65536, 5])
def test_direct_writes_preallocate_and_leave_the_exact_size(tmp_path: Path, nbytes: int) -> None:
    """``O_DIRECT`` puts preallocate the padded file before writing; the published object
    still has exactly header + data bytes (the padding is cut off) and reads back."""

    async def body() -> None:
        b = DiskBackend({"path": str(tmp_path / "tier"), "fsync": True})
        await b.start()
        try:
            if not b.direct_io:
                pytest.skip("this filesystem refuses O_DIRECT")
            key = CacheEngineKey("prealloc", 1, 0, nbytes, "uint8")
            value = random_tensor((nbytes,), torch.uint8, seed=nbytes + 1)
            for src in (value, aligned_empty((nbytes,), torch.uint8).copy_(value)):
                assert await b.put(key, src)
                path = os.path.join(b.root, b._rel(key))
                header = objects_mod.HeaderTemplate(
                    key.to_string(), b._ns_json, torch.uint8, (nbytes,)
                )
                assert os.path.getsize(path) == len(header) + nbytes
                out = torch.zeros(nbytes, dtype=torch.uint8)
                assert await b.get_into(key, out) and same_bits(out, value)
        finally:
            await b.close()

    run(body())


@pytest.mark.parametrize("aligned", [True, False])
def test_truncated_in_a_middle_piece_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aligned: bool
) -> None:
    """A file cut short inside a piece other than the first or last is a miss (counted
    bad and removed), never a hit."""
    monkeypatch.setattr(objects_mod, "READ_PIECE", 65536)
    nbytes = 8 * 65536

    async def body() -> None:
        b = DiskBackend({"path": str(tmp_path / "tier"), "fsync": False})
        await b.start()
        try:
            key = CacheEngineKey("cut", 1, 0, nbytes, "uint8")
            value = random_tensor((nbytes,), torch.uint8, seed=7)
            assert await b.put(key, value)
            path = os.path.join(b.root, b._rel(key))
            os.truncate(path, os.path.getsize(path) - 5 * 65536 + 100)
            out = (
                aligned_empty((nbytes,), torch.uint8)
                if aligned
                else torch.zeros(nbytes + 1, dtype=torch.uint8)[1:]
            )
            assert not await b.get_into(key, out)
            assert b.stats()["bad_objects"] == 1
            assert not os.path.exists(path)
        finally:
            await b.close()

    run(body())


def test_preallocate_allocates_and_refuses_nothing_quietly(tmp_path: Path) -> None:
    """``_preallocate`` gives the file its size; a descriptor that cannot be allocated
    (a pipe) raises, as its write would, instead of passing silently."""
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        objects_mod._preallocate(fd, 3 * 4096)
        assert os.fstat(fd).st_size == 3 * 4096
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        with pytest.raises(OSError):
            objects_mod._preallocate(w, 4096)
    finally:
        os.close(r)
        os.close(w)
