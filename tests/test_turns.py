"""``lmcache_core.turns.ReadTurns``: a device's read queue, compiled and in Python.

Both paths must read exactly what ``os.preadv`` reads, raise the same errors, never have
more than ``n`` reads on the device, and leave nothing behind (reader threads that exit
when idle, a queue that works again in a forked child).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lmcache_core import turns as turns_mod
from lmcache_core.turns import ReadTurns

MiB = 1 << 20

paths = pytest.mark.parametrize(
    "native",
    [
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                turns_mod._native is None,
                reason="lmcache_core._speedups was not built (no C compiler at install)",
            ),
            id="compiled",
        ),
        pytest.param(False, id="python"),
    ],
)


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[int, bytes]:
    data = np.random.default_rng(7).integers(0, 256, 8 * MiB, dtype=np.uint8).tobytes()
    p = tmp_path / "data"
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    yield fd, data  # type: ignore[misc]
    os.close(fd)


@paths
def test_reads_what_preadv_reads_into_several_buffers(
    native: bool, data_file: tuple[int, bytes]
) -> None:
    fd, data = data_file
    t = ReadTurns(2, native=native)
    assert t.native is native
    a, b, c = bytearray(100), memoryview(bytearray(4096)), np.zeros(3 * MiB, np.uint8)
    got = t.preadv(fd, [a, b, c], 12345)
    assert got == 100 + 4096 + 3 * MiB
    assert bytes(a) + bytes(b) + c.tobytes() == data[12345 : 12345 + got]
    # past the end: a short read, as os.preadv
    tail = bytearray(1000)
    assert t.preadv(fd, [tail], len(data) - 10) == 10
    assert bytes(tail[:10]) == data[-10:]
    assert t.preadv(fd, [], 0) == 0
    s = t.stats()
    assert s["native"] is native and s["n"] == 2
    assert s["reads"] == 2 and s["reading"] == 0 and s["queued"] == 0


@paths
def test_errors_are_those_of_preadv_and_leave_the_turns_free(
    native: bool, data_file: tuple[int, bytes]
) -> None:
    fd, data = data_file
    t = ReadTurns(1, native=native)
    with pytest.raises(OSError) as err:
        t.preadv(987_654, [bytearray(8)], 0)
    assert err.value.errno == 9  # EBADF
    with pytest.raises(BufferError):
        t.preadv(fd, [b"read-only"], 0)
    with pytest.raises(TypeError):
        t.preadv(fd, ["not a buffer"], 0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="negative offset"):
        t.preadv(fd, [bytearray(8)], -1)
    # the one turn is free again: a read after every error goes through
    buf = bytearray(64)
    assert t.preadv(fd, [buf], 64) == 64 and bytes(buf) == data[64:128]
    assert t.stats()["reading"] == 0
    with pytest.raises(ValueError):
        ReadTurns(0, native=native)


@paths
def test_many_threads_get_their_own_bytes_and_never_more_than_n_reads_at_once(
    native: bool, data_file: tuple[int, bytes]
) -> None:
    fd, data = data_file
    n = 2
    t = ReadTurns(n, native=native)
    errors: list[str] = []
    peak = {"reading": 0, "threads": 0}
    done = threading.Event()

    def sampler() -> None:
        while not done.is_set():
            s = t.stats()
            peak["reading"] = max(peak["reading"], int(s["reading"]))
            peak["threads"] = max(peak["threads"], int(s["threads"]))

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(40):
            size = int(rng.integers(1, 2 * MiB))
            off = int(rng.integers(0, len(data) - size))
            out = np.empty(size, np.uint8)
            if t.preadv(fd, [out], off) != size or out.tobytes() != data[off : off + size]:
                errors.append(f"thread {seed}: wrong bytes at {off}")

    watch = threading.Thread(target=sampler)
    watch.start()
    threads = [threading.Thread(target=reader, args=(i,)) for i in range(12)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    done.set()
    watch.join()
    assert errors == []
    s = t.stats()
    assert s["reads"] == 12 * 40 and s["reading"] == 0 and s["queued"] == 0
    assert 1 <= peak["reading"] <= n
    assert peak["threads"] <= n


@pytest.mark.skipif(turns_mod._native is None, reason="lmcache_core._speedups was not built")
def test_idle_reader_threads_exit_and_start_again(data_file: tuple[int, bytes]) -> None:
    fd, data = data_file
    t = ReadTurns(2, idle_s=0.05)
    buf = bytearray(4096)
    assert t.preadv(fd, [buf], 0) == 4096
    assert t.stats()["threads"] >= 1
    deadline = time.monotonic() + 5
    while t.stats()["threads"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert t.stats()["threads"] == 0
    assert t.preadv(fd, [buf], 4096) == 4096 and bytes(buf) == data[4096:8192]
    # freeing the queue while its thread waits for work stops and joins it
    assert t.stats()["threads"] == 1
    del t


@paths
def test_a_forked_child_reads_through_the_parents_queue(
    native: bool, data_file: tuple[int, bytes]
) -> None:
    """The child inherits neither the parent's reader threads nor their state; its
    first read starts its own."""
    fd, data = data_file
    t = ReadTurns(2, native=native)
    buf = bytearray(1 << 16)
    t.preadv(fd, [buf], 0)  # the parent's reader thread is alive now
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        ok = False
        try:
            signal.alarm(20)  # a child stuck on the parent's queue state fails, not hangs
            out = bytearray(1 << 16)
            ok = t.preadv(fd, [out], 1 << 16) == 1 << 16 and bytes(out) == data[1 << 16 : 2 << 16]
            ok = ok and t.stats()["reading"] == 0
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert t.preadv(fd, [buf], 0) == len(buf)


def test_the_environment_forces_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(turns_mod.QUEUE_ENV, "python")
    assert not ReadTurns(2).native
    monkeypatch.setenv(turns_mod.QUEUE_ENV, "compiled")
    assert ReadTurns(2).native is (turns_mod._native is not None)
