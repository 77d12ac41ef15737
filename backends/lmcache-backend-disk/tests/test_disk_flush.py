"""A batch's flushes: every object is renamed into place and recorded, then every file
of the batch is flushed (``fdatasync``) and every directory it changed fsynced, all in
one wave issued at once (:meth:`~lmcache_backend_disk.flusher.Flusher.sync_fds`: the
compiled helper where it was built, else the flusher's threads), before the put
returns; a file that fails to flush is a failed put that leaves nothing behind."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch
from disk_testutil import run, temp_files
from lmcache_backend_disk import DiskBackend
from lmcache_backend_disk import sandbox as sandbox_mod
from lmcache_backend_disk.flusher import Flusher

from lmcache_core import CacheEngineKey, flushes
from lmcache_core.testing import random_tensor, same_bits

KiB = 1024


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("flush", 1, 0, i, "uint8")


@pytest.fixture(params=["compiled", "python"])
def wave(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test runs with the compiled wave (where built) and with the Python threads."""
    if request.param == "compiled" and not flushes.native():
        pytest.skip("lmcache_core's compiled module was not built here")
    monkeypatch.setenv(flushes.FLUSHES_ENV, request.param)
    yield request.param


def _path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def test_a_batch_flushes_in_one_wave_after_its_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wave: str
) -> None:
    events: list[tuple[str, object]] = []
    lock = threading.Lock()
    real_sync, real_rename = Flusher.sync_fds, sandbox_mod.TierDir.rename
    root = tmp_path / "tier"

    def sync_fds(
        self: Flusher, fds: Sequence[int], datasync: Sequence[bool]
    ) -> list[OSError | None]:
        calls = [(os.path.relpath(_path(fd), root), d) for fd, d in zip(fds, datasync, strict=True)]
        errors = real_sync(self, fds, datasync)
        with lock:
            events.append(("wave", calls))
        return errors

    def rename(self: sandbox_mod.TierDir, head: str, old: str, new: str) -> None:
        real_rename(self, head, old, new)
        with lock:
            events.append(("rename", f"{head}/{new}"))

    monkeypatch.setattr(Flusher, "sync_fds", sync_fds)
    monkeypatch.setattr(sandbox_mod.TierDir, "rename", rename)
    values = [random_tensor((64 * KiB + i,), torch.uint8, seed=i) for i in range(6)]

    async def body() -> None:
        b = DiskBackend({"path": str(root), "fsync": True})
        await b.start()
        try:
            await b.put(_key(99), values[0])  # the namespace directory exists
            events.clear()
            keys = [_key(i) for i in range(6)]
            assert await b.batched_put(keys, values) == [True] * 6
            returned = list(events)
            for k, v in zip(keys, values, strict=True):
                out = torch.empty_like(v)
                assert await b.get_into(k, out) and same_bits(out, v)
            assert returned[-1][0] == "wave" and [e[0] for e in returned].count("wave") == 1
            renamed = [str(what) for kind, what in returned if kind == "rename"]
            assert sorted(renamed) == sorted(b._rel(k) for k in keys)
            calls = returned[-1][1]
            assert isinstance(calls, list)
            files = {path for path, data in calls if data}
            dirs = {path for path, data in calls if not data}
            # every object was flushed under its final name, after every rename
            assert files == set(renamed)
            # and the directory of every rename fsynced in the same wave
            assert {str(Path(r).parent) for r in renamed} <= dirs
        finally:
            await b.close()

    run(body())


def _fail_flushes_of_size(monkeypatch: pytest.MonkeyPatch, size: int, then: object = None) -> None:
    """Make the flush of files of ``size`` bytes fail with EIO (after ``then(fd)``)."""
    real_sync = Flusher.sync_fds

    def sync_fds(
        self: Flusher, fds: Sequence[int], datasync: Sequence[bool]
    ) -> list[OSError | None]:
        errors = real_sync(self, fds, datasync)
        for i, fd in enumerate(fds):
            if datasync[i] and os.fstat(fd).st_size == size:
                if callable(then):
                    then(fd)
                errors[i] = OSError(errno.EIO, "injected flush failure")
        return errors

    monkeypatch.setattr(Flusher, "sync_fds", sync_fds)


def test_a_file_that_fails_to_flush_is_a_failed_put_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wave: str
) -> None:
    bad_size = 4096 + 96 * KiB  # the object whose flush fails (header + data)
    _fail_flushes_of_size(monkeypatch, bad_size)
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
            assert not (Path(b.root) / b._rel(keys[1])).exists()  # unpublished again
            assert (await b.usage())["used_bytes"] == sum(4096 + n for n in sizes) - bad_size
            for k, v, ok in zip(keys, values, [True, False, True, True], strict=True):
                out = torch.zeros_like(v)
                assert await b.get_into(k, out) is ok
                if ok:
                    assert same_bits(out, v)
            # one object alone: the same rule
            assert await b.put(_key(200), values[1]) is False
            assert await b.contains(_key(200)) is False
            assert b.counters.store_failures == 2 and temp_files(b.root) == []
        finally:
            await b.close()

    run(body())


def test_a_failed_flush_leaves_an_object_another_writer_put_there_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The object whose flush failed is removed only while it is still the file at its
    name: one another writer renamed over it meanwhile (another inode) stays."""
    bad_size = 4096 + 40 * KiB
    value = random_tensor((40 * KiB,), torch.uint8, seed=40)
    other = random_tensor((40 * KiB,), torch.uint8, seed=41)
    root = tmp_path / "tier"

    def replace(fd: int) -> None:
        path = _path(fd)
        with open(path + ".other", "wb") as f:
            f.write(Path(path).read_bytes()[:4096] + other.numpy().tobytes())
        os.rename(path + ".other", path)  # a writer's whole object (its own checksum aside)

    _fail_flushes_of_size(monkeypatch, bad_size, then=replace)

    async def body() -> None:
        b = DiskBackend({"path": str(root), "fsync": True})
        await b.start()
        try:
            k = _key(300)
            assert await b.put(k, value) is False
            assert (root / b._rel(k)).exists()  # the other writer's file was not removed
            assert await b.contains(k)  # nor its record (here: the one this put made)
        finally:
            await b.close()

    run(body())


def test_flusher_sync_fds_reports_each_call(tmp_path: Path, wave: str) -> None:
    """Per descriptor ``None`` or the OSError of its call, compiled or not."""
    f = Flusher("test", max_in_flight=4)
    try:
        good = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o600)
        d = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        r, w = os.pipe()  # fsync of a pipe: EINVAL
        errors = f.sync_fds([good, d, r, 987654], [True, False, False, True])
        assert errors[:2] == [None, None]
        assert isinstance(errors[2], OSError) and errors[2].errno == errno.EINVAL
        assert isinstance(errors[3], OSError) and errors[3].errno == errno.EBADF
        assert f.sync_fds([], []) == []
        for fd in (good, d, r, w):
            os.close(fd)
    finally:
        f.close()


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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wave: str
) -> None:
    """New objects in new directories: each object's directory is fsynced after its
    rename, and the parent of each directory created for the batch after that
    directory's creation, all before ``batched_put`` returns."""
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_sync, real_rename = Flusher.sync_fds, sandbox_mod.TierDir.rename
    root = tmp_path / "tier"

    def sync_fds(
        self: Flusher, fds: Sequence[int], datasync: Sequence[bool]
    ) -> list[OSError | None]:
        errors = real_sync(self, fds, datasync)
        with lock:
            for fd, data, err in zip(fds, datasync, errors, strict=True):
                if not data and err is None and os.path.isdir(_path(fd)):
                    events.append(("dirsync", os.path.relpath(_path(fd), root)))
        return errors

    def rename(self: sandbox_mod.TierDir, head: str, old: str, new: str) -> None:
        real_rename(self, head, old, new)
        with lock:
            events.append(("rename", head))

    monkeypatch.setattr(Flusher, "sync_fds", sync_fds)
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
