"""A batch's flushes: every temporary file is flushed (``fdatasync``) before any of the
batch is renamed into place, the flushes and the directory fsyncs are issued together
(:class:`~lmcache_backend_disk.flusher.Flusher`), and a file that fails to flush is a
failed put that leaves nothing behind."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch
from disk_testutil import run, temp_files
from lmcache_backend_disk import DiskBackend
from lmcache_backend_disk import sandbox as sandbox_mod
from lmcache_backend_disk.flusher import Flusher

from lmcache_core import CacheEngineKey
from lmcache_core.testing import random_tensor, same_bits

KiB = 1024


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("flush", 1, 0, i, "uint8")


def test_a_batch_is_flushed_whole_before_any_object_is_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_fdatasync, real_rename = os.fdatasync, sandbox_mod.TierDir.rename

    def fdatasync(fd: int) -> None:
        real_fdatasync(fd)
        with lock:
            events.append(("sync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))

    def rename(self: sandbox_mod.TierDir, head: str, old: str, new: str) -> None:
        with lock:
            events.append(("rename", old))
        real_rename(self, head, old, new)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(sandbox_mod.TierDir, "rename", rename)
    values = [random_tensor((64 * KiB + i,), torch.uint8, seed=i) for i in range(6)]

    async def body() -> None:
        b = DiskBackend({"path": str(tmp_path / "tier"), "fsync": True})
        await b.start()
        try:
            keys = [_key(i) for i in range(6)]
            assert await b.batched_put(keys, values) == [True] * 6
            for k, v in zip(keys, values, strict=True):
                out = torch.empty_like(v)
                assert await b.get_into(k, out) and same_bits(out, v)
        finally:
            await b.close()

    run(body())
    kinds = [kind for kind, _ in events]
    synced = {name for kind, name in events if kind == "sync"}
    renamed = [name for kind, name in events if kind == "rename"]
    assert len(renamed) == 6 and set(renamed) <= synced  # each published file was flushed
    assert max(i for i, k in enumerate(kinds) if k == "sync" and events[i][1] in renamed) < (
        kinds.index("rename")
    ), "an object was published before the whole batch was flushed"


def test_a_file_that_fails_to_flush_is_a_failed_put_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad_size = 4096 + 96 * KiB  # the object whose flush fails (header + data)
    real_fdatasync = os.fdatasync

    def fdatasync(fd: int) -> None:
        if os.fstat(fd).st_size == bad_size:
            raise OSError(errno.EIO, "injected flush failure")
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    sizes = [64 * KiB, 96 * KiB, 80 * KiB, 72 * KiB]
    values = [random_tensor((n,), torch.uint8, seed=n) for n in sizes]

    async def body() -> None:
        b = DiskBackend({"path": str(tmp_path / "tier"), "fsync": True})
        await b.start()
        try:
            keys = [_key(100 + i) for i in range(4)]
            assert await b.batched_put(keys, values) == [True, False, True, True]
            assert await b.batched_contains(keys) == [True, False, True, True]
            assert b.counters.store_failures == 1
            assert temp_files(b.root) == []
            assert (await b.usage())["used_bytes"] == sum(4096 + n for n in sizes) - bad_size
            for k, v, ok in zip(keys, values, [True, False, True, True], strict=True):
                out = torch.zeros_like(v)
                assert await b.get_into(k, out) is ok
                if ok:
                    assert same_bits(out, v)
        finally:
            await b.close()

    run(body())


def test_flusher_runs_calls_together_reports_errors_and_runs_inline_once_closed() -> None:
    f = Flusher("test", max_in_flight=4)
    meet = threading.Barrier(4)
    # all four must be in flight at once, or the barrier times out
    assert f.run_all(lambda _: meet.wait(timeout=10), range(4)) == [None] * 4

    def fails_on_odd(i: int) -> None:
        if i % 2:
            raise OSError(errno.EIO, f"item {i}")

    errors = f.run_all(fails_on_odd, range(5))
    assert [e is None for e in errors] == [True, False, True, False, True]
    assert all(isinstance(e, OSError) for e in errors[1::2])
    f.close()
    threads: list[int] = []
    assert f.run_all(lambda _: threads.append(threading.get_ident()), range(3)) == [None] * 3
    assert threads == [threading.get_ident()] * 3


@pytest.mark.parametrize("nbytes", [2 << 20, (4 << 20) + 4096, 3 * 4096])
def test_aligned_memory_is_aligned_and_lives_as_long_as_any_view(nbytes: int) -> None:
    """``aligned_empty`` and staging buffers from 2 MiB up start on a 2 MiB boundary (huge
    pages asked for there); smaller ones on 4 KiB. A view keeps the memory alive."""
    from lmcache_backend_disk import aligned_empty
    from lmcache_backend_disk.aligned import HUGE, AlignedBuffer

    boundary = HUGE if nbytes >= HUGE else 4096
    t = aligned_empty((nbytes // 2,), torch.bfloat16)
    assert t.data_ptr() % boundary == 0 and t.is_contiguous() and t.shape == (nbytes // 2,)
    t.view(torch.uint8).copy_(random_tensor((nbytes,), torch.uint8, seed=1))
    tail = t[-7:]
    want = tail.clone()
    del t
    torch.empty(nbytes, dtype=torch.uint8).fill_(0xEE)  # reuse of freed memory would show
    assert same_bits(tail, want)
    buf = AlignedBuffer(nbytes)
    try:
        assert buf.tensor.data_ptr() % boundary == 0 and len(buf.view) == buf.tensor.numel()
        buf.view[-1:] = b"\x07"
        assert int(buf.tensor[-1]) == 7
    finally:
        del tail
        buf.close()


def test_every_directory_a_batch_changed_is_fsynced_before_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """New objects in new directories: each object's directory is fsynced after its
    rename, and the parent of each directory created for the batch after that
    directory's creation, all before ``batched_put`` returns."""
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_fsync, real_rename = os.fsync, sandbox_mod.TierDir.rename
    root = tmp_path / "tier"

    def fsync(fd: int) -> None:
        real_fsync(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            with lock:
                events.append(("dirsync", os.path.relpath(path, root)))

    def rename(self: sandbox_mod.TierDir, head: str, old: str, new: str) -> None:
        real_rename(self, head, old, new)
        with lock:
            events.append(("rename", head))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(sandbox_mod.TierDir, "rename", rename)
    values = [random_tensor((8 * KiB + i,), torch.uint8, seed=i) for i in range(12)]

    async def body() -> None:
        b = DiskBackend({"path": str(root), "fsync": True})
        await b.start()
        try:
            await b.put(_key(1000), values[0])  # the namespace directory exists
            events.clear()
            keys = [_key(2000 + i) for i in range(12)]
            assert await b.batched_put(keys, values) == [True] * 12
            returned = len(events)
            leaves = {str(Path(b._rel(k)).parent) for k in keys}
            parents = {str(Path(d).parent) for d in leaves}
            synced = [(i, d) for i, (kind, d) in enumerate(events[:returned]) if kind == "dirsync"]
            for leaf in leaves:
                renamed_at = max(
                    i for i, (k, d) in enumerate(events) if k == "rename" and d == leaf
                )
                assert any(i > renamed_at and d == leaf for i, d in synced), leaf
            assert parents <= {d for _, d in synced}
        finally:
            await b.close()

    run(body())
