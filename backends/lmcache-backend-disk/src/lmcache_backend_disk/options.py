"""Options of the ``disk`` backend (validated by :func:`lmcache_core.config.options.build_options`)."""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_core.config.options import option
from lmcache_core.errors import ConfigError

__all__ = ["DiskOptions", "parse_mode"]


@dataclass(frozen=True)
class DiskOptions:
    """Options of the ``disk`` backend."""

    path: str = option(
        kind="path",
        doc="Directory of the tier (created if missing). Every process using it shares its "
        "data and its max_bytes bound. /dev/shm/<dir> makes a same-host DRAM tier.",
    )
    max_bytes: int = option(
        "16GiB",
        kind="bytes",
        minimum=1,
        doc="Bound on the bytes of all objects under path, whichever process wrote them; "
        "least recently used entries are evicted to make room.",
    )
    mode: str = option(
        "0600",
        doc="Permission bits of object files (octal); directories get the matching x bits "
        "(0600 -> 0700). Use 0660 to share a tier within a group.",
    )
    direct_io: str = option(
        "auto",
        choices=("auto", "true", "false"),
        doc="O_DIRECT with aligned reused buffers: auto (when the filesystem accepts it), "
        "true (refuse to start otherwise), false (buffered I/O).",
    )
    small_pages: str = option(
        "auto",
        choices=("auto", "stage", "direct"),
        doc="O_DIRECT transfers with an aligned caller tensor in ordinary 4 KiB pages: "
        "stage (through a huge-page buffer and a copy: the device gets fewer, larger "
        "requests), direct (the tensor's own pages), auto (on a virtio-blk disk whose segment "
        "limit splits such transfers, stage tensors larger than one request carries from small "
        "pages that start inside a page, i.e. from a malloc heap, where that was measured "
        "faster; else direct). "
        "Memory mapped by huge pages, or where the kernel cannot tell (before Linux 6.7), "
        "is always used directly.",
    )
    fsync: bool = option(
        True,
        doc="fdatasync each object and fsync its directory before a put returns (survives "
        "power loss). Without it, publication is still atomic against process crashes.",
    )
    concurrency: int = option(
        32,
        minimum=1,
        maximum=256,
        doc="File operations in flight (size of the I/O thread pool). Each one also does "
        "some Python work, so it takes more of them than a raw loop's 16 to keep a fast "
        "device's queue as full.",
    )
    reads_in_flight: int = option(
        2,
        minimum=1,
        maximum=256,
        doc="O_DIRECT read requests (of up to 4 MiB) on the device at once; the pool's other "
        "reads wait for a turn. A batch's reads then finish one after another and each one's "
        "checksum (and copy into an unaligned buffer) overlaps the next reads, instead of "
        "all of them landing together at the end and their CPU work trailing the device. "
        "Raise it for a device that needs more requests in flight (bench_disk.py prints qd1 "
        "against qd16).",
    )
    io_nice: int = option(
        0,
        minimum=0,
        maximum=19,
        doc="Niceness added to the I/O threads (default 0: the process's priority). They run "
        "Python: when other processes load every core, a niced thread holding the GIL stalls "
        "the event loop and every other thread.",
    )
    stale_temp_seconds: float = option(
        3600.0,
        minimum=1.0,
        doc="gc and index rebuilds remove temporary files this old even when their writer "
        "cannot be proven dead (writers that died are cleaned up at start).",
    )
    touch_interval: float = option(
        1.0,
        minimum=0.0,
        doc="Seconds between flushes of read times to the shared LRU index (a write flushes "
        "them at once).",
    )
    lookup_refresh_s: float = option(
        0.01,
        minimum=0.0,
        maximum=60.0,
        doc="Lookups answer from an in-memory view of the shared index; it catches up with "
        "other processes' puts and evictions at most this many seconds after they commit "
        "(this process's own at once; 0: ask the index at every lookup, ~10 us).",
    )

    staging_bytes: int = option(
        "1GiB",
        kind="bytes",
        minimum=0,
        doc="Idle O_DIRECT staging buffers kept for reuse between bursts (each I/O in flight "
        "holds one; concurrency x chunk size keeps a burst of unaligned values from "
        "page-faulting fresh memory); a buffer unused for 30 s is released, so an idle "
        "backend holds none.",
    )
    pin_seconds: float = option(
        300.0,
        minimum=0.001,
        maximum=86400.0,
        doc="Lifetime of a pin taken by pin()/pin_many() (lookup leases): eviction in every "
        "process skips a pinned entry until it is unpinned or this many seconds pass, so a "
        "process that hangs or dies cannot pin forever.",
    )

    def __post_init__(self) -> None:
        parse_mode(self.mode)


def parse_mode(text: str) -> int:
    """The file permission bits of an octal ``mode`` option (``"0600"`` -> ``0o600``)."""
    try:
        value = int(text, 8)
    except (TypeError, ValueError):
        raise ConfigError(
            f"expected octal permission bits such as '0600', got {text!r}", "options.mode"
        ) from None
    if value & ~0o777 or (value & 0o600) != 0o600:
        raise ConfigError(
            f"mode {text!r} must be within 0777 and let the owner read and write (0600 at least)",
            "options.mode",
        )
    return value


def dir_mode(file_mode: int) -> int:
    """Directory permission bits matching ``file_mode``: x wherever r is set."""
    mode = file_mode
    for r_bit, x_bit in ((0o400, 0o100), (0o040, 0o010), (0o004, 0o001)):
        if file_mode & r_bit:
            mode |= x_bit
    return mode
