"""SyncBackend and the IO loop thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from lmcache_core import BackendClosedError, CPUBackend, IOLoopThread, SyncBackend
from lmcache_core.testing import make_key, random_tensor, run_async, same_bits


def test_sync_calls_run_on_one_io_thread() -> None:
    backend = CPUBackend({"max_bytes": "64MiB"})
    with SyncBackend(backend) as sb:
        k = make_key("s")
        v = random_tensor((1000,), torch.float16, seed=1)
        assert sb.put(k, v)
        assert sb.contains(k)
        assert same_bits(sb.get(k), v)
        out = torch.empty_like(v)
        assert sb.get_into(k, out) and same_bits(out, v)
        assert sb.batched_contains([k, make_key("x")]) == [True, False]
        assert sb.batched_put([make_key("a")], [v]) == [True]
        outs = [torch.empty_like(v)]
        assert sb.batched_get_into([k], outs) == [True]
        assert sb.batched_get([k])[0] is not None
        assert sb.remove(k)
        assert sb.stats()["hits"] >= 3
    with pytest.raises(BackendClosedError):
        run_async(backend.get(k))


def test_calls_from_many_threads() -> None:
    sb = SyncBackend(CPUBackend({"max_bytes": "64MiB"}))
    sb.start()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for j in range(50):
                k = make_key(f"t{i}-{j}")
                v = random_tensor((64,), torch.float32, seed=i * 100 + j)
                assert sb.put(k, v)
                assert same_bits(sb.get(k), v)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sb.close()
    sb.close()  # idempotent
    assert not errors


def test_refuses_calls_from_inside_its_loop() -> None:
    io = IOLoopThread()
    sb = SyncBackend(CPUBackend(), loop_thread=io)
    sb.start()

    async def inside() -> str:
        try:
            sb.contains(make_key("x"))
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    assert "inside the lmcache IO loop" in io.run(inside())
    sb.close()
    assert io.loop.is_running()  # a shared loop is not stopped by the facade
    io.stop()


def test_submit_returns_a_future() -> None:
    with SyncBackend(CPUBackend()) as sb:
        k = make_key("f")
        fut = sb.submit(sb.backend.put(k, torch.ones(3)))
        assert fut.result(5) is True
        assert sb.contains(k)


class _LateWriter:
    """A backend whose loads write into the buffer from a thread 0.3 s later (a read a
    backend runs in a thread goes on when its coroutine is cancelled)."""

    name = "late"

    def __init__(self) -> None:
        self.writes = 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _fill(self, outs: list[torch.Tensor]) -> None:
        time.sleep(0.3)
        for o in outs:
            o.fill_(7)
        self.writes += 1

    async def get_into(self, key: object, out: torch.Tensor) -> bool:
        await asyncio.to_thread(self._fill, [out])
        return True

    async def batched_get_into(self, keys: list[object], outs: list[torch.Tensor]) -> list[bool]:
        await asyncio.to_thread(self._fill, list(outs))
        return [True] * len(keys)


@pytest.mark.parametrize("batched", [False, True])
def test_a_load_past_its_timeout_never_writes_into_the_callers_buffer_later(
    batched: bool,
) -> None:
    late = _LateWriter()
    with SyncBackend(late, timeout=0.05) as sb:  # type: ignore[arg-type]
        out = torch.zeros(1024, dtype=torch.uint8)
        with pytest.raises(TimeoutError):
            if batched:
                sb.batched_get_into([make_key("k")], [out])
            else:
                sb.get_into(make_key("k"), out)
        deadline = time.monotonic() + 5
        while late.writes == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert late.writes == 1  # the backend's thread did write, into its own buffer
        assert int(out.sum()) == 0
    # and a call within its timeout fills the caller's buffer
    with SyncBackend(_LateWriter(), timeout=5.0) as sb:  # type: ignore[arg-type]
        out = torch.zeros(1024, dtype=torch.uint8)
        if batched:
            assert sb.batched_get_into([make_key("k")], [out]) == [True]
        else:
            assert sb.get_into(make_key("k"), out)
        assert bool((out == 7).all())
