"""Byte-level helpers for host memory.

Host-to-host copies use ``memmove`` (through ctypes, which releases the GIL), not
torch's ``copy_``: torch splits a large CPU copy across its OpenMP team (2 threads here),
and when other work holds a core -- a vLLM worker's forward pass, other processes -- the
team waits for its descheduled thread. ``benchmarks/bench_copy.py`` (interleaved, quiet
and with one busy process per core) measured a 4 MiB ``copy_`` at 4-35 ms at the 90th
percentile whenever other work ran, against under 0.7 ms for one ``memmove``; with both
cores free ``copy_`` was up to ~1.9x faster, since one thread does not reach the memory
bandwidth.

Copies of at least :data:`SPLIT_MIN` bytes are shared with one helper thread: the
calling thread copies the first half while the helper is woken, then both take pieces of
the rest (the caller from the front, the helper from the back, :class:`_Shared`). So the
caller never waits for a helper that has not started (a helper that is descheduled, or
slow to wake, leaves the whole copy to the caller, as one ``memmove`` would), only for
the one piece the helper may be copying when the caller runs out. Where the optional
compiled module was built (``lmcache_core._speedups.copy_shared``) the same algorithm
runs in C with a native helper thread, which starts without the ~0.1 ms a Python
thread needs to get the GIL, so sharing pays from 4 MiB instead of 8 MiB; the
Python helper below is the fallback. Copies involving a device tensor still go through
torch.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable

import torch

from .libc import libc_function

__all__ = [
    "SPLIT_MIN",
    "as_bytes",
    "copy_into",
    "copy_tensor",
    "host_copy",
    "mapped_empty",
    "pinned_available",
    "populated_empty",
    "shared_copy_stats",
    "staging_empty",
]

_memmove = ctypes.memmove

_native_copy: Callable[[int, int, int], None] | None
try:  # the compiled shared copy (setup.py); None: the Python helper thread below
    from ._speedups import copy_shared as _native_copy
except ImportError:  # pragma: no cover - exercised by builds without a C compiler
    _native_copy = None

#: Host copies of at least this many bytes are shared with the helper thread (``0``: never;
#: the environment variable ``LMCACHE_CORE_COPY_SPLIT_MIN`` sets it, in bytes). 4 MiB with
#: the compiled helper (2 MiB copies gained within noise), 8 MiB with the Python one
#: (``docs/performance.md``, "Compiled helpers").
SPLIT_MIN = int(
    os.environ.get("LMCACHE_CORE_COPY_SPLIT_MIN", str((4 << 20) if _native_copy else (8 << 20)))
)
#: Smallest piece of a shared copy.
PIECE_MIN = 256 << 10


class _Shared:
    """One copy of ``n`` bytes shared by the caller and the helper thread.

    The caller copies the first half at once (the helper is still being woken), then the
    rest is cut into pieces of :data:`PIECE_MIN` bytes or more (a sixteenth of the copy):
    the caller claims them from the front, the helper from the back, one at a time under
    ``lock``. A helper that starts late holds at most one piece when the caller runs
    out, so the caller never waits for more than one piece (and never for a helper that
    has not started)."""

    __slots__ = ("back", "busy", "done", "dst", "front", "lock", "n", "piece", "src", "waiting")

    def __init__(self, dst: int, src: int, n: int) -> None:
        self.dst, self.src, self.n = dst, src, n
        self.piece = max(PIECE_MIN, (n // 16) & ~4095)
        self.front = (n // 2) & ~4095  # the caller's first part ends here
        self.back = n  # the helper's pieces end here (it copies back to front)
        self.lock = threading.Lock()
        self.busy = False  # the helper is copying a piece it claimed
        self.waiting = False  # the caller waits for that piece
        self.done = threading.Lock()
        self.done.acquire()  # released for a waiting caller when the helper's piece is done

    def help(self) -> bool:
        """In the helper thread: pieces from the back until none is left (``True`` when
        it copied any)."""
        helped = False
        lock = self.lock
        while True:
            with lock:
                self.busy = False
                if self.waiting:
                    self.done.release()
                    return helped
                if self.back <= self.front:
                    return helped
                start = max(self.front, self.back - self.piece)
                end, self.back = self.back, start
                self.busy = True
            _memmove(self.dst + start, self.src + start, end - start)
            helped = True

    def run(self) -> float | None:
        """In the calling thread: the first half, then pieces from the front until none
        is left, then wait for the helper's piece if it is still copying one (the bytes
        must all be in place when the call returns). Returns how long the caller waited
        (seconds), ``None`` when the helper took no part."""
        _memmove(self.dst, self.src, self.front)
        lock = self.lock
        while True:
            with lock:
                if self.front >= self.back:
                    if not self.busy:
                        helped = self.back < self.n
                        self.back = self.front  # nothing left for a late helper
                        return 0.0 if helped else None
                    self.waiting = True
                    break
                start = self.front
                end = self.front = min(self.back, start + self.piece)
            _memmove(self.dst + start, self.src + start, end - start)
        t0 = time.monotonic()
        self.done.acquire()
        return time.monotonic() - t0


#: A caller that waited longer than this for the helper's part turns sharing off for a
#: while (:class:`_CopyHelper`).
STALL_S = 0.001
#: Longest pause of sharing after stalls (seconds).
MAX_PAUSE_S = 30.0


class _CopyHelper:
    """The helper thread, started on first use (again in a forked child).

    When the cores are loaded the helper can be descheduled in the middle of its part (or
    wait for the GIL after it), and the caller waits for it: a 4 MiB copy that takes
    ~0.3 ms alone took up to ~4 ms in ``bench_copy.py``'s loaded condition. So a wait
    longer than :data:`STALL_S` pauses sharing (plain ``memmove`` in the caller) for 0.5 s,
    doubling with each further stall up to :data:`MAX_PAUSE_S`; a copy the helper shared
    without a stall resets the pause (one the caller copied alone, the helper late, says
    nothing either way).
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Shared] = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()
        #: Copies the helper copied pieces of (for tests and statistics).
        self.helped = 0
        #: Copies whose caller waited longer than STALL_S for the helper.
        self.stalls = 0
        self._streak = 0
        self._paused_until = 0.0

    def copy(self, dst: int, src: int, n: int) -> None:
        if self._paused_until and time.monotonic() < self._paused_until:
            _memmove(dst, src, n)
            return
        job = _Shared(dst, src, n)
        if not self._started:
            self._start()
        self._jobs.put(job)
        waited = job.run()
        if waited is None:  # the caller copied it all: says nothing either way
            return
        if waited > STALL_S:
            self.stalls += 1
            self._streak += 1
            pause = min(MAX_PAUSE_S, 0.5 * 2.0 ** min(self._streak - 1, 10))
            self._paused_until = time.monotonic() + pause
        elif self._streak:
            self._streak = 0
            self._paused_until = 0.0

    def _start(self) -> None:
        with self._lock:
            if self._started:
                return
            t = threading.Thread(target=self._serve, name="lmcache-copy-helper", daemon=True)
            t.start()
            self._started = True

    def _serve(self) -> None:
        get = self._jobs.get
        while True:
            if get().help():
                self.helped += 1

    def _after_fork(self) -> None:
        self._jobs = queue.SimpleQueue()
        self._started = False
        self._lock = threading.Lock()
        self._streak = 0
        self._paused_until = 0.0


_helper = _CopyHelper()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_helper._after_fork)


def shared_copy_stats() -> tuple[str, int, int]:
    """``(helper, helped, stalls)``: which helper shares large copies (``"native"`` or
    ``"python"``), how many copies it took part in, and its stalls (each pauses
    sharing: the caller waited over 1 ms for the helper; native also: a shared copy ran
    over 1 ms longer than 4 GB/s would), since the process (or forked child) started."""
    if _native_copy is not None:
        from ._speedups import copy_stats

        helped, stalls, _ = copy_stats()
        return "native", helped, stalls
    return "python", _helper.helped, _helper.stalls


def host_copy(dst_ptr: int, src_ptr: int, n: int) -> None:
    """Copy ``n`` bytes between host addresses: one ``memmove``, shared with the helper
    thread from :data:`SPLIT_MIN` bytes on when the two ranges do not overlap."""
    if SPLIT_MIN and n >= SPLIT_MIN and (dst_ptr >= src_ptr + n or src_ptr >= dst_ptr + n):
        native = _native_copy
        if native is not None:
            native(dst_ptr, src_ptr, n)
        else:
            _helper.copy(dst_ptr, src_ptr, n)
    elif n:
        _memmove(dst_ptr, src_ptr, n)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (zero copy)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bytes of ``src`` into ``dst`` (same byte size, both contiguous).

    Host to host this is ``memmove`` through ctypes, which releases the GIL and costs
    2-3 µs of overhead per call (``benchmarks/bench_copy.py``; see the module docstring
    for why not ``copy_``, and for the helper thread that shares copies of at least
    :data:`SPLIT_MIN` bytes).
    """
    if dst.is_cpu and src.is_cpu:
        n = dst.nbytes
        if n != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into a {n}-byte buffer")
        if not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError("copy_into needs contiguous tensors")
        if n:
            host_copy(dst.data_ptr(), src.data_ptr(), n)
        return
    as_bytes(dst).copy_(as_bytes(src), non_blocking=False)


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src``: one ``memmove`` when both are contiguous host tensors of one
    dtype and shape (see the module docstring), torch's ``copy_`` otherwise (device
    tensors, strided views, dtype conversions), in inference mode: vLLM's KV buffers are
    inference tensors, which an in-place ``copy_`` outside it refuses."""
    if (
        dst.is_cpu
        and src.is_cpu
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
    ):
        copy_into(dst, src)
        return
    with torch.inference_mode():
        dst.copy_(src)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
# (None: not Linux / no libc symbol: memory faults on first use)
_madvise: ctypes._CFuncPtr | None = libc_function("madvise")  # type: ignore[name-defined]
if _madvise is not None:
    _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _madvise.restype = ctypes.c_int


def populated_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh host memory as a flat uint8 tensor, its pages already faulted in.

    A private anonymous mapping whose pages are faulted in by
    ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+), called through ctypes so the GIL is
    released meanwhile (``mmap``'s own ``MAP_POPULATE`` holds it: a thread populating
    4 MiB mappings delayed the other threads' wake-ups by up to 100-260 ms here). Fresh
    memory is expensive on virtual machines that hand freed pages back to their host: a
    4 MiB copy into a new ``torch.empty`` costs several times one into memory already
    faulted in (``benchmarks/bench_copy.py --fresh``). Where the ``madvise`` is not
    available the pages fault on first use, as ``torch.empty``'s do. The tensor keeps the
    mapping alive."""
    t = mapped_empty(nbytes)
    if _madvise is not None and nbytes > 0:
        _madvise(t.data_ptr(), nbytes, _MADV_POPULATE_WRITE)  # (failure: faults on first use)
    return t


def mapped_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh host memory as a flat uint8 tensor over its own private anonymous
    mapping: page-aligned (so ``O_DIRECT`` can write from it without a bounce copy) and
    cheap to make; its pages fault in on first use. ``torch.empty`` where mapping fails."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError, AttributeError):
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes)


def pinned_available() -> bool:
    """Whether page-locked host memory can be allocated (CUDA present; CPU-only torch
    raises on ``pin_memory=True``)."""
    return bool(torch.cuda.is_available())


def staging_empty(
    shape: tuple[int, ...], dtype: torch.dtype, pin: bool | None = None
) -> torch.Tensor:
    """A host staging buffer: page-locked when ``pin`` (default: when CUDA is available),
    so device copies from and into it can run asynchronously on a side stream."""
    if pin is None:
        pin = pinned_available()
    return torch.empty(shape, dtype=dtype, pin_memory=pin)
