"""``memory.copy_tensor``: one ``memmove`` for contiguous host tensors of one dtype and
shape, torch's ``copy_`` for everything else, and the same bytes either way."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from lmcache_core import memory


@pytest.fixture
def memmoves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Byte counts of the ``memmove`` calls ``copy_tensor`` makes (the real copy still runs)."""
    calls: list[int] = []
    real = memory._memmove

    def counting(dst: int, src: int, n: int) -> int:
        calls.append(n)
        return int(real(dst, src, n))

    monkeypatch.setattr(memory, "_memmove", counting)
    return calls


def test_contiguous_host_tensors_take_one_memmove(memmoves: list[int]) -> None:
    src = torch.randn(3, 5, 7, dtype=torch.float32)
    dst = torch.zeros_like(src)
    memory.copy_tensor(dst, src)
    assert torch.equal(dst, src)
    assert memmoves == [src.nbytes]


def test_inference_tensors_are_copied_outside_inference_mode(memmoves: list[int]) -> None:
    # vLLM's KV buffers are inference tensors: a plain in-place copy_ into one raises
    with torch.inference_mode():
        dst = torch.zeros(64, dtype=torch.bfloat16)
    src = torch.randn(64).to(torch.bfloat16)
    with pytest.raises(RuntimeError):
        dst.copy_(src)
    memory.copy_tensor(dst, src)
    assert torch.equal(dst, src) and memmoves == [dst.nbytes]
    strided = src.view(8, 8).t()  # the fallback runs in inference mode too
    memory.copy_tensor(dst.view(8, 8), strided)
    assert torch.equal(dst.view(8, 8), strided) and len(memmoves) == 1


def test_views_conversions_and_broadcasts_use_torch(memmoves: list[int]) -> None:
    base = torch.arange(48, dtype=torch.float32).view(6, 8)
    # a strided destination: the bytes must land element by element, not in a row
    dst = torch.zeros(8, 6, dtype=torch.float32).t()
    memory.copy_tensor(dst, base)
    assert torch.equal(dst, base)
    # another dtype of the same byte size: a conversion, never a reinterpretation
    as_int = torch.zeros(6, 8, dtype=torch.int32)
    memory.copy_tensor(as_int, base)
    assert torch.equal(as_int, base.to(torch.int32))
    # another shape (a broadcast)
    row = torch.zeros(6, 8, dtype=torch.float32)
    memory.copy_tensor(row, base[0])
    assert torch.equal(row, base[0].expand(6, 8))
    assert memmoves == []


def test_empty_tensors_copy_nothing(memmoves: list[int]) -> None:
    memory.copy_tensor(torch.empty(0), torch.empty(0))
    assert memmoves == []


# ---------------------------------------------------------------- large copies, two threads
@pytest.fixture(autouse=True)
def _share_from_2_mib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies are shared from 2 MiB on in these tests (the Python helper's default is
    larger), so they stay quick; the code path is the same."""
    monkeypatch.setattr(memory, "SPLIT_MIN", 2 << 20)


try:
    from lmcache_core import _speedups
except ImportError:  # pragma: no cover - only where no C compiler was available
    _speedups = None  # type: ignore[assignment]


class _Impl:
    """One implementation of the shared copy, with what the tests read of it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def helped(self) -> int:
        return memory.shared_copy_stats()[1]  # the fixture set which helper is in use

    def stalls(self) -> int:
        return memory.shared_copy_stats()[2]

    def paused_s(self) -> float:
        if self.name == "native":
            return _speedups.copy_stats()[2]
        return max(0.0, memory._helper._paused_until - time.monotonic())


@pytest.fixture(params=["native", "python"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Impl]:
    """The compiled helper (``lmcache_core._speedups.copy_shared``) and the Python one."""
    if request.param == "native":
        if _speedups is None:
            pytest.skip("lmcache_core._speedups was not built (no C compiler at install)")
        monkeypatch.setattr(memory, "_native_copy", _speedups.copy_shared)
        _speedups.copy_reset()
        yield _Impl("native")
        _speedups.copy_debug(0, 0)
        _speedups.copy_reset()
    else:
        monkeypatch.setattr(memory, "_native_copy", None)
        monkeypatch.setattr(memory._helper, "_paused_until", 0.0)
        monkeypatch.setattr(memory._helper, "_streak", 0)
        yield _Impl("python")


def _bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("delta", [-1, 0, 1, 4095, (3 << 20) + 7, (29 << 20) + 4093])
def test_large_copies_land_whole_around_the_split_size(impl: _Impl, delta: int) -> None:
    n = memory.SPLIT_MIN + delta
    src = _bytes(n, delta & 0xFFFF)
    dst = torch.zeros(n + 2, dtype=torch.uint8)  # a guard byte on each side
    memory.copy_into(dst[1 : n + 1], src)
    assert torch.equal(dst[1 : n + 1], src)
    assert dst[0] == 0 and dst[n + 1] == 0


def test_the_helper_thread_copies_part_of_large_copies(impl: _Impl) -> None:
    n = 8 << 20
    src, dst = _bytes(n, 1), torch.zeros(n, dtype=torch.uint8)
    before = impl.helped()
    for _ in range(40):
        dst.zero_()
        memory.copy_into(dst, src)
        assert torch.equal(dst, src)
    assert impl.helped() > before  # fails if the caller always copied alone


def test_a_helper_that_never_starts_does_not_hold_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Jobs queued where no thread reads them: every copy is still whole, by the caller."""
    import queue

    monkeypatch.setattr(memory, "_native_copy", None)
    monkeypatch.setattr(memory._helper, "_jobs", queue.SimpleQueue())
    monkeypatch.setattr(memory._helper, "_started", True)
    n = 4 << 20
    src, dst = _bytes(n, 2), torch.zeros(n, dtype=torch.uint8)
    t0 = time.monotonic()
    for _ in range(10):
        dst.zero_()
        memory.copy_into(dst, src)
        assert torch.equal(dst, src)
    assert time.monotonic() - t0 < 5.0


@pytest.mark.skipif(_speedups is None, reason="lmcache_core._speedups was not built")
def test_a_native_helper_slow_to_claim_leaves_the_copy_to_the_caller() -> None:
    """The native helper made to sleep 50 ms after waking, before it claims a piece (as
    when its core is taken): each copy is whole, by the caller, without waiting for it."""

    _speedups.copy_reset()
    _speedups.copy_debug(50_000, 0)
    try:
        n = 4 << 20
        src, dst = _bytes(n, 7), torch.zeros(n, dtype=torch.uint8)
        helped = _speedups.copy_stats()[0]
        t0 = time.monotonic()
        for _ in range(5):
            dst.zero_()
            _speedups.copy_shared(dst.data_ptr(), src.data_ptr(), n)
            assert torch.equal(dst, src)
        assert time.monotonic() - t0 < 0.2  # five copies, never a 50 ms wait
        assert _speedups.copy_stats()[0] == helped
    finally:
        _speedups.copy_debug(0, 0)
        time.sleep(0.06)  # the helper's last sleep ends; it finds nothing to claim


def test_overlapping_ranges_copy_as_one_memmove(impl: _Impl) -> None:
    n = memory.SPLIT_MIN + (1 << 20)
    buf = _bytes(n + 4096, 3)
    want = buf[:n].clone()
    helped = impl.helped()
    memory.host_copy(buf.data_ptr() + 4096, buf.data_ptr(), n)  # forward overlap
    assert torch.equal(buf[4096:], want)
    buf = _bytes(n + 4096, 4)
    want = buf[4096:].clone()
    memory.host_copy(buf.data_ptr(), buf.data_ptr() + 4096, n)  # backward overlap
    assert torch.equal(buf[:n], want)
    assert impl.helped() == helped


def test_overlapping_ranges_take_the_python_path_as_one_memmove(
    memmoves: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "_native_copy", None)
    n = memory.SPLIT_MIN + (1 << 20)
    buf = _bytes(n + 4096, 3)
    memory.host_copy(buf.data_ptr() + 4096, buf.data_ptr(), n)
    assert memmoves == [n]


@pytest.mark.skipif(_speedups is None, reason="lmcache_core._speedups was not built")
def test_native_copy_checks_its_arguments() -> None:
    buf = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError):
        _speedups.copy_shared(buf.data_ptr(), buf.data_ptr(), -1)
    with pytest.raises(TypeError):
        _speedups.copy_shared(buf.data_ptr(), buf.data_ptr())  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _speedups.copy_shared("x", buf.data_ptr(), 1)  # type: ignore[arg-type]
    _speedups.copy_shared(0, 0, 0)  # nothing to copy: no address is touched


def test_copies_from_many_threads_at_once(impl: _Impl) -> None:
    import threading

    n = (3 << 20) + 123
    srcs = [_bytes(n, 10 + i) for i in range(4)]
    errors: list[str] = []

    def worker(i: int) -> None:
        dst = torch.empty(n, dtype=torch.uint8)
        for _ in range(25):
            dst.zero_()
            memory.copy_into(dst, srcs[i])
            if not torch.equal(dst, srcs[i]):
                errors.append(f"thread {i}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_forked_child_copies_with_its_own_helper(impl: _Impl) -> None:
    import os

    import numpy as np

    n = 4 << 20
    src = _bytes(n, 4)
    memory.copy_into(torch.empty(n, dtype=torch.uint8), src)  # the parent's helper runs
    src_np = src.numpy()
    pid = os.fork()
    if pid == 0:  # the child: no helper thread until its first large copy
        code = 1
        try:  # numpy only around the copies: torch's OpenMP team does not survive a fork
            dst_np = np.zeros(n, dtype=np.uint8)
            dst = torch.from_numpy(dst_np)
            ok = True
            helped = impl.helped()
            for _ in range(40):
                dst_np[:] = 0
                memory.copy_into(dst, src)
                ok = ok and bool(np.array_equal(dst_np, src_np))
            started = memory._helper._started if impl.name == "python" else True
            code = 0 if ok and started and impl.helped() > helped else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_stalled_helper_pauses_sharing(impl: _Impl, monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper that is slow inside its part (as when descheduled): the caller waits for
    it (the copy is whole), counts a stall, and copies alone while sharing is paused."""
    import threading

    if impl.name == "native":
        _speedups.copy_debug(0, 5000)  # 5 ms inside each piece the helper claims
    else:
        real = memory._memmove

        def slow_in_helper(dst: int, src: int, n: int) -> int:
            if threading.current_thread().name == "lmcache-copy-helper":
                time.sleep(0.005)
            return int(real(dst, src, n))

        monkeypatch.setattr(memory, "_memmove", slow_in_helper)
    n = 4 << 20
    src, dst = _bytes(n, 5), torch.zeros(n, dtype=torch.uint8)
    stalls = impl.stalls()
    for _ in range(200):  # until the helper claims a part (it usually does at once)
        dst.zero_()
        memory.copy_into(dst, src)
        assert torch.equal(dst, src)
        if impl.stalls() > stalls:
            break
    assert impl.stalls() == stalls + 1
    assert impl.paused_s() > (0.03 if impl.name == "native" else 0.3)  # 50 ms / 0.5 s
    checked = 0
    for _ in range(10):  # paused: the caller copies alone
        if impl.paused_s() < 0.01:  # the native pause is short: only copies well inside it
            break
        helped = impl.helped()
        dst.zero_()
        memory.copy_into(dst, src)
        assert torch.equal(dst, src)
        assert impl.helped() == helped
        checked += 1
    assert checked >= 1 and impl.stalls() == stalls + 1


def _debug_copy(
    seed: int, claim_delay_us: int, caller_delay_us: int, reset: bool = True
) -> tuple[tuple[int, int, float], tuple[int, int, float]]:
    """One 4 MiB native shared copy with the helper and/or the caller made slow (the pause
    and stall history cleared first unless ``reset`` is false); checks the bytes and
    returns the copy stats before and after it."""
    if reset:
        _speedups.copy_reset()
    n = 4 << 20
    src, dst = _bytes(n, seed), torch.zeros(n, dtype=torch.uint8)
    before = _speedups.copy_stats()
    _speedups.copy_debug(claim_delay_us, 0, caller_delay_us)
    try:
        _speedups.copy_shared(dst.data_ptr(), src.data_ptr(), n)
    finally:
        _speedups.copy_debug(0, 0, 0)
    assert torch.equal(dst, src)
    return before, _speedups.copy_stats()


@pytest.mark.skipif(_speedups is None, reason="lmcache_core._speedups was not built")
def test_a_native_copy_that_runs_long_without_its_helper_pauses_sharing() -> None:
    """The caller descheduled for 5 ms right after posting a 4 MiB copy and the helper
    for 10 ms after waking (other work on every core): the caller copies it all, far
    slower than 4 GB/s, with no help: a stall, and sharing pauses."""

    n = 4 << 20
    src, dst = _bytes(n, 8), torch.zeros(n, dtype=torch.uint8)
    (helped, stalls, _), (now_helped, now_stalls, paused) = _debug_copy(8, 10_000, 5000)
    assert now_helped == helped  # the helper woke after the caller had finished
    assert now_stalls == stalls + 1 and paused > 0.03  # 50 ms
    time.sleep(0.012)  # the helper's 10 ms sleep ends; it finds nothing to claim
    if _speedups.copy_stats()[2] > 0.01:  # still well inside the pause: copies alone
        _speedups.copy_shared(dst.data_ptr(), src.data_ptr(), n)
        assert torch.equal(dst, src) and _speedups.copy_stats()[0] == helped
    _speedups.copy_reset()


@pytest.mark.skipif(_speedups is None, reason="lmcache_core._speedups was not built")
def test_a_native_copy_slow_for_the_caller_alone_keeps_sharing() -> None:
    """The caller descheduled for 5 ms after posting, the helper on time: the helper
    copies its half meanwhile (sharing worked), so the long copy is no stall."""
    (helped, stalls, _), (now_helped, now_stalls, paused) = _debug_copy(9, 0, 5000)
    assert now_helped == helped + 1 and now_stalls == stalls and paused == 0.0


@pytest.mark.skipif(_speedups is None, reason="lmcache_core._speedups was not built")
def test_native_stalls_that_recur_pause_sharing_for_longer() -> None:
    """An isolated stall pauses sharing for 50 ms; a second one within the next 32 shared
    copies (other work holding the cores) pauses it for 1 s, doubling after that."""

    try:
        _, (_, stalls, paused) = _debug_copy(10, 10_000, 5000)
        assert 0.03 < paused <= 0.05
        time.sleep(0.06)  # the 50 ms pause ends (and the helper's 10 ms sleep)
        _, (_, stalls2, paused2) = _debug_copy(11, 10_000, 5000, reset=False)
        assert stalls2 == stalls + 1 and 0.9 < paused2 <= 1.0
        time.sleep(0.012)
    finally:
        _speedups.copy_reset()
    assert _speedups.copy_stats()[2] == 0.0
