"""``lmcache_core.flushes.sync_fds``: a wave of fsync/fdatasync calls made at once by the
compiled helper, or ``None`` where the caller must make them itself."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

from lmcache_core import flushes


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    if flushes._native is None or not hasattr(flushes._native, "sync_fds"):
        pytest.skip("lmcache_core's compiled module was not built here")
    monkeypatch.delenv(flushes.FLUSHES_ENV, raising=False)


def test_each_call_reports_its_own_error(tmp_path: Path, compiled: None) -> None:
    files = [os.open(tmp_path / f"f{i}", os.O_CREAT | os.O_WRONLY, 0o600) for i in range(70)]
    d = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    r, w = os.pipe()
    try:
        for fd in files:
            os.write(fd, b"x" * 4096)
        # more calls than the helper's 64 threads: the caller and the threads take the rest
        fds = [*files, d, r, 1 << 20]
        errors = flushes.sync_fds(fds, [True] * len(files) + [False, False, True])
        assert errors is not None and errors[: len(files) + 1] == [None] * (len(files) + 1)
        assert isinstance(errors[-2], OSError) and errors[-2].errno == errno.EINVAL  # a pipe
        assert isinstance(errors[-1], OSError) and errors[-1].errno == errno.EBADF
        assert flushes.sync_fds([], []) == []
    finally:
        for fd in [*files, d, r, w]:
            os.close(fd)


def test_the_calls_run_with_the_gil_released(tmp_path: Path, compiled: None) -> None:
    """A Python thread keeps running while a wave of real flushes is in progress."""
    fds = [os.open(tmp_path / f"g{i}", os.O_CREAT | os.O_WRONLY, 0o600) for i in range(8)]
    ticks = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        for _ in range(20):
            for fd in fds:
                os.write(fd, b"y" * 4096)
            before = ticks[0]
            assert flushes.sync_fds(fds, [True] * len(fds)) == [None] * len(fds)
            if ticks[0] > before:
                break
        else:
            pytest.fail("no Python code ran during any of 20 waves")
    finally:
        stop.set()
        t.join()
        for fd in fds:
            os.close(fd)


def test_the_environment_variable_and_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(flushes.FLUSHES_ENV, "python")
    assert not flushes.native()
    assert flushes.sync_fds([0], [True]) is None  # the caller makes the calls
    with pytest.raises(ValueError, match="differ in length"):
        flushes.sync_fds([0, 1], [True])
    if flushes._native is not None and hasattr(flushes._native, "sync_fds"):
        with pytest.raises(ValueError, match="differ in length"):
            flushes._native.sync_fds([0, 1], [True])
        with pytest.raises(TypeError):
            flushes._native.sync_fds(["x"], [True])
