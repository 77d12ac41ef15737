"""The device I/O's use of kvikio, with a fake ``CuFile`` doing real POSIX I/O on host
tensors (an extra unit layer: kvikio's device paths need a GPU; ``test_gds_cuda.py``
runs the real ones there). What is checked is this backend's side of the contract:
pieces of ``task_size`` submitted as one kvikio task each, every piece waited for before
the file is closed (also after one failed), the bytes and checksum right, and the disk
tier reading what was written."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache_backend_gds import GdsBackend, runtime
from lmcache_backend_gds.stripe import GdsStripe

from lmcache_core import format as fmt
from lmcache_core.keys import CacheEngineKey

TASK = 64 << 10


class _Future:
    def __init__(self, fn: Any) -> None:
        self.waited = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()

        def run() -> None:
            try:
                self._result = fn()
            except BaseException as exc:
                self._error = exc
            self._done.set()

        threading.Thread(target=run).start()

    def get(self) -> int:
        self._done.wait()
        self.waited = True
        if self._error is not None:
            raise self._error
        return int(self._result)


class FakeCuFile:
    """``kvikio.CuFile`` over POSIX calls; ``fail_at`` makes the piece at that file
    offset fail (after a delay, so that later pieces are still running then)."""

    fail_at: int | None = None
    log: list[tuple[str, int, int, int]] = []
    futures: list[_Future] = []

    def __init__(self, name: str, flags: str) -> None:
        assert name.startswith("/proc/self/fd/"), name
        self.fd = os.open(name, os.O_RDWR if flags == "r+" else os.O_RDONLY)
        self.closed = False

    def _io(self, kind: str, buf: torch.Tensor, size: int, off: int, task: int) -> _Future:
        assert buf.is_contiguous() and buf.numel() == size and task >= size
        FakeCuFile.log.append((kind, size, off, task))
        mv = memoryview(buf.numpy()).cast("B")

        def work() -> int:
            if off == FakeCuFile.fail_at:
                time.sleep(0.05)
                raise RuntimeError("cuFile error at: cuFileRead (EIO)")
            time.sleep(0.01)
            assert not self.closed, "a piece ran after the file was closed"
            if kind == "pwrite":
                return os.pwrite(self.fd, mv, off)
            return os.preadv(self.fd, [mv], off)

        fut = _Future(work)
        FakeCuFile.futures.append(fut)
        return fut

    def pwrite(self, buf: torch.Tensor, size: int, off: int, task: int) -> _Future:
        return self._io("pwrite", buf, size, off, task)

    def pread(self, buf: torch.Tensor, size: int, off: int, task: int) -> _Future:
        return self._io("pread", buf, size, off, task)

    def close(self) -> None:
        assert all(f.waited for f in FakeCuFile.futures), "closed with pieces not waited for"
        self.closed = True
        os.close(self.fd)


@pytest.fixture
def stripe(tmp_path: Path) -> Any:
    FakeCuFile.fail_at, FakeCuFile.log, FakeCuFile.futures = None, [], []
    loop = asyncio.new_event_loop()
    b = GdsBackend({"path": str(tmp_path / "t"), "max_bytes": "1GiB", "task_size": TASK})
    loop.run_until_complete(b.start())
    s: GdsStripe = b.stripes[0]
    s.use_io_path(
        runtime.IoPath("compat", "fake", "0-fake"), types.SimpleNamespace(CuFile=FakeCuFile)
    )
    yield s
    loop.run_until_complete(b.close())
    loop.close()


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, 100 + i, "float16")


def test_pieces_of_task_size_round_trip_and_the_disk_tier_reads_them(stripe: GdsStripe) -> None:
    dev = stripe._device_io
    assert dev is not None
    v = (torch.rand(5, 70_000) * 100).to(torch.float16)  # 700,000 bytes: 11 pieces, a tail
    w = stripe._plan(_key(1), v)
    dev.write_temp_device(w.tmp, w.template, v)
    writes = [e for e in FakeCuFile.log if e[0] == "pwrite"]
    assert [e[2] for e in writes] == [4096 + k * TASK for k in range(len(writes))]
    assert sum(e[1] for e in writes) == v.numel() * 2 and len(writes) == 11
    path = os.path.join(stripe.root, w.tmp)
    with open(path, "rb") as f:
        raw = f.read()
    assert fmt.decode_header(raw, total_size=len(raw)).checksum == fmt.checksum(v)
    out = torch.empty_like(v)
    res = dev.read_into_device(w.tmp, _key(1).to_string(), stripe._ns_json, out)
    assert res.outcome.name == "HIT" and torch.equal(out.view(torch.uint8), v.view(torch.uint8))
    host = torch.empty_like(v)  # the disk tier's own read of the same file
    assert (
        stripe.io.read_into(w.tmp, _key(1).to_string(), stripe._ns_json, host).outcome.name == "HIT"
    )
    assert torch.equal(host.view(torch.uint8), v.view(torch.uint8))


def test_a_failed_piece_waits_for_the_others_before_the_close(stripe: GdsStripe) -> None:
    dev = stripe._device_io
    assert dev is not None
    v = torch.ones(400_000, dtype=torch.float16)  # 800,000 bytes: 13 pieces
    w = stripe._plan(_key(2), v)
    FakeCuFile.fail_at = 4096 + TASK  # the second piece fails, the others still run
    with pytest.raises(RuntimeError, match="cuFileRead"):
        dev.write_temp_device(w.tmp, w.template, v)
    assert len(FakeCuFile.futures) == 13 and all(f.waited for f in FakeCuFile.futures)
    assert not os.path.exists(os.path.join(stripe.root, w.tmp))  # removed on error
