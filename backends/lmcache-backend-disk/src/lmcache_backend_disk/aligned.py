"""Page-aligned memory for ``O_DIRECT`` I/O: reusable staging buffers and aligned tensors.

``O_DIRECT`` transfers need the memory address, the file offset and the length aligned
(here to 4096 bytes, which satisfies every device's logical block size). Tensors from
``torch.empty`` are only 64-byte aligned, so writes go through a staging buffer and reads
land directly in the caller's tensor only when it is aligned (see :func:`aligned_empty`;
:func:`probe_direct_mem_align` finds where a finer alignment suffices: 4 bytes on NVMe).
Staging buffers are anonymous ``mmap`` regions, reused so the hot path never page-faults.

Buffers of 2 MiB or more start on a 2 MiB boundary and ask for transparent huge pages
(``MADV_HUGEPAGE``; THP is ``madvise``-only on many systems). An ``O_DIRECT`` request
becomes one device segment per physically contiguous run of its memory, and a device
takes a bounded number of segments per request: 4 KiB pages that are scattered (as a
reused ``malloc`` heap hands them out) split each 4 MiB transfer into several device
requests - 5.5 per write and 7.2 per read into such ``torch.empty`` memory here, against
2.0 and 2.1 into huge pages (``/sys/block/vda/stat``) - and each request costs the
device's per-request time.

A caller's tensor that happens to be aligned (``torch.empty`` returns 512-byte aligned
memory for some allocations) but lies in scattered 4 KiB pages is therefore better staged
through a huge-page buffer and copied, on a device where the split costs:
:func:`huge_backed` tells whether memory is mapped by huge pages (``PAGEMAP_SCAN``,
Linux 6.7+), :func:`small_page_request_bytes` how much one request of a device carries
from scattered 4 KiB pages where that is less than its largest request, and
:func:`auto_stage_over_bytes` what the disk tier's ``small_pages: auto`` makes of both.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import random
import threading
import time
from pathlib import Path

import torch

from lmcache_core.libc import libc_function

__all__ = [
    "ALIGN",
    "AlignedBuffer",
    "BufferPool",
    "aligned_empty",
    "auto_stage_over_bytes",
    "disk_sysfs_node",
    "huge_backed",
    "huge_pages_available",
    "is_aligned",
    "probe_direct_io",
    "probe_direct_mem_align",
    "round_up",
    "scattered_small_pages",
    "small_page_request_bytes",
]

ALIGN = 4096
#: Size and alignment of a transparent huge page (x86-64, arm64 with 4 KiB pages).
HUGE = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def scattered_small_pages(nbytes: int, seed: int = 0) -> torch.Tensor:
    """A page-aligned uint8 tensor of ``nbytes`` in ordinary 4 KiB pages faulted in a
    shuffled order, so its physical pages are scattered as a long-lived ``malloc`` heap's
    are (for benchmarks and tests of transfers from such memory). The tensor keeps its
    private anonymous mapping alive."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    pages = list(range(-(-nbytes // ALIGN)))
    random.Random(seed).shuffle(pages)
    for p in pages:
        m[p * ALIGN] = 0
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes)


def is_aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s data starts on an ``ALIGN`` boundary."""
    return t.data_ptr() % ALIGN == 0


def aligned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor whose data is 4096-byte aligned.

    ``get_into`` reads straight into such a tensor with ``O_DIRECT`` (no staging copy).
    From 2 MiB up the tensor lives in its own private mapping, 2 MiB aligned, with
    transparent huge pages asked for (``MADV_HUGEPAGE``): physically contiguous memory
    moves in fewer, larger device requests (see the module's docstring). The mapping is
    released when the tensor and every view of it are gone.
    """
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes >= HUGE:
        flat = _mapped(nbytes)
    else:
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
        offset = (-raw.data_ptr()) % ALIGN
        flat = raw[offset : offset + nbytes]
    if dtype == torch.uint8:
        return flat.view(tuple(shape))
    return flat.view(dtype).view(tuple(shape))


def _huge_map(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping with room for ``nbytes`` from a 2 MiB boundary; the
    mapping and the offset of that boundary in it. Huge pages are asked for only where
    they lie wholly inside those ``nbytes`` (a partial last 2 MiB keeps 4 KiB pages), so
    the memory used never exceeds ``nbytes`` rounded up to 4 KiB; the slack around them
    is never touched, so never backed."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe = torch.frombuffer(m, dtype=torch.uint8, count=1)
    offset = (-probe.data_ptr()) % HUGE
    del probe
    whole = nbytes - nbytes % HUGE
    if _MADV_HUGEPAGE is not None and whole:
        try:
            m.madvise(_MADV_HUGEPAGE, offset, whole)
        except OSError:  # THP compiled out or disabled: ordinary pages
            pass
    return m, offset


def _mapped(nbytes: int) -> torch.Tensor:
    """``nbytes`` of a :func:`_huge_map` mapping as a uint8 tensor (which keeps it alive)."""
    m, offset = _huge_map(nbytes)
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset)


class AlignedBuffer:
    """A page-aligned private anonymous mapping with a uint8 tensor and a memoryview over it.

    Private, not ``mmap(-1)``'s default ``MAP_SHARED``: shared anonymous memory is shmem,
    and ``O_DIRECT`` transfers to and from shmem pages ran at about half the speed of
    ordinary memory here (``benchmarks/bench_peer.py``: staged 32 MiB reads 0.6-0.7 GB/s
    against 1.4-1.6 into ordinary aligned memory). From 2 MiB up it starts on a 2 MiB
    boundary with huge pages asked for (see the module's docstring)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        if nbytes >= HUGE:
            self._map, offset = _huge_map(nbytes)
        else:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self._map, offset = mmap.mmap(-1, max(nbytes, ALIGN), flags=flags), 0
        self.view = memoryview(self._map)[offset : offset + nbytes]
        self.tensor = (
            torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=offset)
            if nbytes
            else (torch.empty(0, dtype=torch.uint8))
        )

    def close(self) -> None:
        self.view.release()
        del self.tensor
        try:
            self._map.close()
        except BufferError:  # a tensor view is still alive somewhere; the GC will unmap
            pass


class BufferPool:
    """Reusable :class:`AlignedBuffer` objects, by size.

    At most ``max_bytes`` of buffers are kept idle, and an idle buffer not taken again
    within ``idle_seconds`` is released (a timer thread does it, so a backend that goes
    quiet gives its staging memory back without waiting for ``close()``). Buffers in use
    are not counted: each I/O in flight holds one.
    """

    def __init__(self, max_bytes: int, idle_seconds: float = 5.0) -> None:
        self.max_bytes = max_bytes
        self.idle_seconds = idle_seconds
        self._free: dict[int, list[tuple[AlignedBuffer, float]]] = {}
        self._idle = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._closed = False

    @property
    def idle_bytes(self) -> int:
        """Bytes of the buffers kept for reuse now."""
        return self._idle

    def take(self, nbytes: int) -> AlignedBuffer:
        """A buffer of at least ``nbytes`` (rounded up to ``ALIGN``)."""
        size = round_up(max(nbytes, 1))
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                self._idle -= size
                buf = bucket.pop()[0]
                if not bucket:
                    del self._free[size]
                return buf
        return AlignedBuffer(size)

    def give(self, buf: AlignedBuffer) -> None:
        """Return a buffer for reuse (released when the pool is full)."""
        now = time.monotonic()
        with self._lock:
            if self._closed or buf.nbytes > self.max_bytes:
                buf.close()
                return
            while self._idle + buf.nbytes > self.max_bytes:
                self._drop_oldest()
            self._free.setdefault(buf.nbytes, []).append((buf, now))
            self._idle += buf.nbytes
            if self._timer is None:
                self._schedule(self.idle_seconds)

    def _drop_oldest(self) -> None:
        size = min(self._free, key=lambda s: self._free[s][0][1])
        bucket = self._free[size]
        victim = bucket.pop(0)[0]
        if not bucket:
            del self._free[size]
        self._idle -= size
        victim.close()

    def _schedule(self, delay: float) -> None:
        timer = threading.Timer(delay, self.release_idle)
        timer.daemon = True
        self._timer = timer
        timer.start()

    def release_idle(self, now: float | None = None) -> int:
        """Release the buffers idle for ``idle_seconds`` or more; the bytes released."""
        now = time.monotonic() if now is None else now
        released = 0
        with self._lock:
            self._timer = None
            for size in list(self._free):
                bucket = self._free[size]
                keep = [(b, t) for b, t in bucket if now - t < self.idle_seconds]
                for b, t in bucket:
                    if now - t >= self.idle_seconds:
                        b.close()
                        released += size
                if keep:
                    self._free[size] = keep
                else:
                    del self._free[size]
            self._idle -= released
            if self._free and not self._closed:
                youngest = max(t for bucket in self._free.values() for _, t in bucket)
                self._schedule(max(0.05, youngest + self.idle_seconds - now))
        return released

    def clear(self) -> None:
        """Release every idle buffer and stop the timer (buffers given back later are
        released at once)."""
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for bucket in self._free.values():
                for buf, _ in bucket:
                    buf.close()
            self._free.clear()
            self._idle = 0


def probe_direct_io(dir_fd: int, name: str) -> bool:
    """Whether files in the directory ``dir_fd`` accept ``O_DIRECT`` writes and reads of
    aligned blocks (probed with a new file ``name``, removed afterwards)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    buf = AlignedBuffer(ALIGN)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW | flag
    try:
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    except OSError:
        buf.close()
        return False
    try:
        buf.view[:] = b"\x5a" * ALIGN
        if os.pwrite(fd, buf.view, 0) != ALIGN:
            return False
        buf.view[:] = b"\0" * ALIGN
        return os.preadv(fd, [buf.view], 0) == ALIGN and bytes(buf.view[:4]) == b"\x5a" * 4
    except OSError:
        return False
    finally:
        _discard_probe(fd, dir_fd, name, buf)


def _discard_probe(fd: int, dir_fd: int, name: str, buf: AlignedBuffer) -> None:
    """Close and remove a probe file and release its buffer."""
    os.close(fd)
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass
    buf.close()


_STATX_DIOALIGN = 0x2000
_AT_EMPTY_PATH = 0x1000
_STATX_SIZE = 256
_STATX_DIO_MEM_ALIGN_AT = 0x98  # struct statx: stx_dio_mem_align (u32), then the offset one


def _statx_dio_align(fd: int) -> tuple[int, int] | None:
    """``(stx_dio_mem_align, stx_dio_offset_align)`` of the open file ``fd`` (Linux 6.1+,
    glibc 2.28+), or ``None`` where the system or the filesystem does not report them."""
    fn = libc_function("statx")
    if fn is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if fn(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
        return None
    mask = int.from_bytes(buf.raw[0:4], "little")
    at = _STATX_DIO_MEM_ALIGN_AT
    mem = int.from_bytes(buf.raw[at : at + 4], "little")
    off = int.from_bytes(buf.raw[at + 4 : at + 8], "little")
    if not mask & _STATX_DIOALIGN or not mem or not off:
        return None
    return mem, off


def probe_direct_mem_align(dir_fd: int, name: str) -> int:
    """The memory alignment ``O_DIRECT`` transfers of files in ``dir_fd`` need, when it is
    finer than :data:`ALIGN`: what the filesystem reports (``statx`` ``STATX_DIOALIGN``;
    the device's DMA alignment: 512 bytes on virtio disks, 4 on NVMe), checked by a write
    and a read of a probe file ``name`` (removed afterwards) from and into memory aligned
    to exactly that. :data:`ALIGN` wherever anything is unknown, larger or fails."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return ALIGN
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW | flag
    try:
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    except OSError:
        return ALIGN
    buf = AlignedBuffer(3 * ALIGN)
    try:
        got = _statx_dio_align(fd)
        if got is None:
            return ALIGN
        mem, off = got
        if mem >= ALIGN or mem & (mem - 1) or ALIGN % off:
            return ALIGN
        # memory aligned to ``mem`` and to nothing coarser: ``ALIGN + mem`` into the buffer
        view = buf.view[ALIGN + mem : 2 * ALIGN + mem]
        view[:] = bytes(range(256)) * (ALIGN // 256)
        if os.pwritev(fd, [view], 0) != ALIGN:
            return ALIGN
        view[:] = b"\0" * ALIGN
        if os.preadv(fd, [view], 0) != ALIGN or bytes(view) != bytes(range(256)) * (ALIGN // 256):
            return ALIGN
        return mem
    except OSError:
        return ALIGN
    finally:
        _discard_probe(fd, dir_fd, name, buf)


# ---------------------------------------------------------------- page sizes of memory
class _PageRegion(ctypes.Structure):
    _fields_ = [
        ("start", ctypes.c_uint64),
        ("end", ctypes.c_uint64),
        ("categories", ctypes.c_uint64),
    ]


class _PmScanArg(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "size",
            "flags",
            "start",
            "end",
            "walk_end",
            "vec",
            "vec_len",
            "max_pages",
            "category_inverted",
            "category_mask",
            "category_anyof_mask",
            "return_mask",
        )
    ]


#: ``_IOWR('f', 16, struct pm_scan_arg)`` and the two page categories asked for
#: (include/uapi/linux/fs.h).
_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_PmScanArg) << 16) | (ord("f") << 8) | 16
_PAGE_IS_PRESENT = 1 << 3
_PAGE_IS_HUGE = 1 << 6


class _Pagemap:
    """``/proc/self/pagemap`` of this process, opened on first use and again after a
    fork (the descriptor names the process that opened it); ``supported`` turns false
    once the kernel refuses ``PAGEMAP_SCAN``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd = -1
        self._pid = 0
        self.supported = True
        self._ioctl = libc_function("ioctl")
        if self._ioctl is None:
            self.supported = False
        else:
            self._ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
            self._ioctl.restype = ctypes.c_int

    def fd(self) -> int:
        with self._lock:
            if self._pid != os.getpid():
                if self._fd >= 0:  # a forked child's copy of its parent's descriptor
                    os.close(self._fd)
                    self._fd = -1
                self._fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
                self._pid = os.getpid()
            return self._fd

    def huge(self, addr: int, nbytes: int) -> bool | None:
        if not self.supported or nbytes <= 0:
            return None
        try:
            fd = self.fd()
        except OSError:
            self.supported = False
            return None
        regions = (_PageRegion * 2)()
        start = addr - addr % ALIGN
        end = round_up(addr + nbytes)
        arg = _PmScanArg(
            size=ctypes.sizeof(_PmScanArg),
            start=start,
            end=end,
            vec=ctypes.addressof(regions),
            vec_len=2,
            return_mask=_PAGE_IS_PRESENT | _PAGE_IS_HUGE,
        )
        assert self._ioctl is not None
        got = self._ioctl(fd, _PAGEMAP_SCAN, ctypes.byref(arg))
        if got < 0:
            if ctypes.get_errno() in (errno.ENOTTY, errno.EINVAL):  # no PAGEMAP_SCAN here
                self.supported = False
            return None
        # adjacent pages of the same categories come back as one region
        want = _PAGE_IS_PRESENT | _PAGE_IS_HUGE
        return bool(
            got == 1
            and regions[0].start == start
            and regions[0].end == end
            and regions[0].categories == want
        )


_PAGEMAP = _Pagemap()


def huge_backed(addr: int, nbytes: int) -> bool | None:
    """Whether every page of the memory ``[addr, addr + nbytes)`` of this process is
    present and mapped by huge pages (``PAGEMAP_SCAN`` of ``/proc/self/pagemap``, Linux
    6.7+; no privilege needed); ``None`` where the kernel cannot tell. Memory not yet
    touched is not huge-backed (``False``)."""
    return _PAGEMAP.huge(addr, nbytes)


def disk_sysfs_node(dev: int, sys_root: str = "/sys") -> Path:
    """The sysfs directory of the whole disk holding the block device ``dev`` (an
    ``st_dev``; a partition's parent disk). Raises ``OSError`` where there is none."""
    node = Path(sys_root, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}").resolve(strict=True)
    return node.parent if (node / "partition").exists() else node


def small_page_request_bytes(dev: int, sys_root: str = "/sys") -> int | None:
    """The most bytes one device request carries from scattered 4 KiB pages on the block
    device ``dev`` (an ``st_dev``), where that is less than its largest request and each
    request was measured to cost: on a virtio-blk disk (docs/backends/disk.md, "Caller
    memory and device requests"), ``max_segments`` x 4 KiB when below ``max_sectors_kb``
    (1016 KiB against 4 MiB here). ``None`` where segments do not bind or anything is
    unknown (another driver, a stacked device, no sysfs)."""
    try:
        node = disk_sysfs_node(dev, sys_root)
        queue = node / "queue"
        driver = (node / "device" / "driver").resolve(strict=True).name
        max_segments = int((queue / "max_segments").read_text())
        max_request = int((queue / "max_sectors_kb").read_text()) * 1024
    except (OSError, ValueError):
        return None
    if driver != "virtio_blk" or max_segments <= 0 or max_segments * ALIGN >= max_request:
        return None
    return max_segments * ALIGN


def huge_pages_available(sys_root: str = "/sys") -> bool:
    """Whether transparent huge pages can back memory that asks for them (``always`` or
    ``madvise`` in ``kernel/mm/transparent_hugepage/enabled``): without them the staging
    buffers are small pages too, and staging would buy a copy and nothing else."""
    try:
        text = Path(sys_root, "kernel", "mm", "transparent_hugepage", "enabled").read_text()
    except OSError:
        return False
    return "[always]" in text or "[madvise]" in text


def auto_stage_over_bytes(dev: int, sys_root: str = "/sys") -> int:
    """What ``small_pages: auto`` decides for a tier on the block device ``dev``: stage
    small-page tensors larger than this many bytes (0: none), i.e. what one request
    carries from such pages where that splits transfers (:func:`small_page_request_bytes`)
    and huge pages can back the staging buffers (:func:`huge_pages_available`)."""
    if not huge_pages_available(sys_root):
        return 0
    return small_page_request_bytes(dev, sys_root) or 0
