"""Caller memory in 4 KiB pages: ``huge_backed`` tells it from huge pages,
``small_page_request_bytes`` reads a device's queue limits, and the ``small_pages`` option sends
aligned tensors in small pages through a huge-page staging buffer (bit-exact either way)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from disk_testutil import record_takes, run
from lmcache_backend_disk import DiskBackend, aligned_empty
from lmcache_backend_disk.aligned import (
    auto_stage_over_bytes,
    huge_backed,
    huge_pages_available,
    scattered_small_pages,
    small_page_request_bytes,
)

from lmcache_core import CacheEngineKey
from lmcache_core.errors import ConfigError
from lmcache_core.testing import random_tensor, same_bits

MiB = 1 << 20
N = 4 * MiB


def small_pages(nbytes: int, seed: int = 0) -> torch.Tensor:
    return scattered_small_pages(nbytes, seed)


def smaps_huge_kib(addr: int) -> int | None:
    """``AnonHugePages`` of the mapping holding ``addr`` (``None``: no such mapping)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return None


def _need_pagemap_scan() -> None:
    probe = small_pages(8192)
    if huge_backed(probe.data_ptr(), 8192) is None:
        pytest.skip("this kernel has no PAGEMAP_SCAN (Linux 6.7+): huge pages are not told")


def test_small_and_untouched_pages_are_not_huge_backed() -> None:
    _need_pagemap_scan()
    small = small_pages(N)
    assert huge_backed(small.data_ptr(), N) is False
    assert huge_backed(small.data_ptr() + 100, 5000) is False
    untouched = aligned_empty((N,), torch.uint8)  # asked for huge pages, never touched
    assert huge_backed(untouched.data_ptr(), N) is False


def test_huge_backed_agrees_with_smaps() -> None:
    """``aligned_empty`` memory asks for transparent huge pages; whether the kernel gave
    them (``/proc/self/smaps``) is what ``huge_backed`` must report, for the whole range
    and for part of it."""
    _need_pagemap_scan()
    t = aligned_empty((N,), torch.uint8)
    t.fill_(1)
    kib = smaps_huge_kib(t.data_ptr())
    assert kib is not None
    whole = kib * 1024 >= N
    assert huge_backed(t.data_ptr(), N) is whole
    assert huge_backed(t.data_ptr() + 4096 + 7, MiB) is whole
    if not whole:
        pytest.skip("the kernel gave this process no huge pages (THP off or memory short)")


def test_huge_backed_works_in_a_forked_child() -> None:
    """The pagemap descriptor names the process that opened it: a child must open its own."""
    _need_pagemap_scan()
    small = small_pages(N)
    huge_backed(small.data_ptr(), N)  # the parent's descriptor is open now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            ans = huge_backed(small.data_ptr(), N)
            os.write(w, repr(ans).encode())
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 100).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert got == "False"


def _fake_sysfs(root: Path, driver: str, max_segments: int, max_sectors_kb: int) -> None:
    disk = root / "devices" / "pci0000:00" / "virtio1" / "block" / "vda"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "max_segments").write_text(f"{max_segments}\n")
    (disk / "queue" / "max_sectors_kb").write_text(f"{max_sectors_kb}\n")
    drv = root / "bus" / "drivers" / driver
    drv.mkdir(parents=True)
    (disk / "device").mkdir()
    (disk / "device" / "driver").symlink_to(drv)
    part = disk / "vda1"
    part.mkdir()
    (part / "partition").write_text("1\n")
    (root / "dev" / "block").mkdir(parents=True)
    (root / "dev" / "block" / "254:0").symlink_to(disk)
    (root / "dev" / "block" / "254:1").symlink_to(part)


@pytest.mark.parametrize(
    ("driver", "segments", "sectors_kb", "transfer", "want"),
    [
        ("virtio_blk", 254, 4096, N, True),  # this machine's disk: 1016 KiB per request
        ("virtio_blk", 254, 4096, 512 * 1024, False),  # fits one request anyway
        ("virtio_blk", 254, 512, N, False),  # the request limit binds first
        ("virtio_blk", 2048, 4096, N, False),  # segments are not the limit
        ("nvme", 127, 1280, N, False),  # not measured there: direct
    ],
)
def test_small_page_requests_read_the_device_queue(
    tmp_path: Path, driver: str, segments: int, sectors_kb: int, transfer: int, want: bool
) -> None:
    """``want``: a transfer of ``transfer`` bytes from scattered small pages is split into
    more requests than from huge pages on that device."""
    _fake_sysfs(tmp_path, driver, segments, sectors_kb)
    for minor in (0, 1):  # the disk, and a partition of it (limits of its disk)
        limit = small_page_request_bytes(os.makedev(254, minor), str(tmp_path))
        assert (limit is not None and limit < transfer) is want
        assert limit == (segments * 4096 if segments * 4096 < sectors_kb * 1024 and
                         driver == "virtio_blk" else None)  # fmt: skip


def test_small_page_requests_are_unknown_where_anything_is_unknown(tmp_path: Path) -> None:
    assert small_page_request_bytes(os.makedev(254, 0), str(tmp_path)) is None  # no sysfs
    _fake_sysfs(tmp_path, "virtio_blk", 254, 4096)
    assert small_page_request_bytes(os.makedev(254, 7), str(tmp_path)) is None  # no device
    q = tmp_path / "devices" / "pci0000:00" / "virtio1" / "block" / "vda" / "queue"
    (q / "max_segments").write_text("many\n")
    assert small_page_request_bytes(os.makedev(254, 0), str(tmp_path)) is None


@pytest.mark.parametrize(
    ("thp", "want"), [("always [madvise] never\n", 254 * 4096), ("always madvise [never]\n", 0)]
)
def test_auto_stages_only_where_requests_split_and_huge_pages_exist(
    tmp_path: Path, thp: str, want: int
) -> None:
    _fake_sysfs(tmp_path, "virtio_blk", 254, 4096)
    d = tmp_path / "kernel" / "mm" / "transparent_hugepage"
    d.mkdir(parents=True)
    (d / "enabled").write_text(thp)
    assert auto_stage_over_bytes(os.makedev(254, 1), str(tmp_path)) == want
    assert auto_stage_over_bytes(os.makedev(254, 7), str(tmp_path)) == 0  # no such device


def _backend(root: Path, mode: str) -> DiskBackend:
    return DiskBackend(
        {"path": str(root), "max_bytes": "256MiB", "direct_io": "true", "small_pages": mode}
    )


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("small-pages", 1, 0, i + 1, "uint8")


def test_stage_sends_small_page_tensors_through_staging(tmp_path: Path) -> None:
    """``stage``: a put from and a read into an aligned tensor in 4 KiB pages both go
    through an object-sized staging buffer, counted, bit-exact; ``direct`` uses the
    tensor's own pages (bounce blocks only)."""
    _need_pagemap_scan()

    async def body() -> None:
        for mode, staged in (("stage", True), ("direct", False)):
            b = _backend(tmp_path / mode, mode)
            await b.start()
            try:
                assert b.stats()["stage_small_pages"] is staged
                assert b.stats()["stage_small_pages_over_bytes"] == (4096 if staged else 0)
                val = random_tensor((N,), torch.uint8, seed=3)
                src = small_pages(N, seed=1)
                src.copy_(val)
                taken = record_takes(b)
                assert await b.put(_key(0), src)
                out = small_pages(N, seed=2)
                assert await b.get_into(_key(0), out)
                assert same_bits(out, val)
                if staged:
                    assert b.stats()["small_page_stagings"] == 2
                    assert sum(1 for t in taken if t >= N) == 2, taken
                else:
                    assert b.stats()["small_page_stagings"] == 0
                    assert max(taken) < 64 * 1024, taken
            finally:
                await b.close()

    run(body())


def test_stage_uses_huge_page_tensors_directly(tmp_path: Path) -> None:
    """Under ``stage``, a tensor the kernel maps with huge pages is still read into
    directly (that is what the staging buffer would give the device)."""
    _need_pagemap_scan()
    out = aligned_empty((N,), torch.uint8)
    out.fill_(7)  # not zeros: the kernel may split a huge page of zeros ("underused")
    if not huge_backed(out.data_ptr(), N):
        pytest.skip("the kernel gave this process no huge pages (THP off or memory short)")

    async def body() -> None:
        b = _backend(tmp_path / "t", "stage")
        await b.start()
        try:
            val = random_tensor((N,), torch.uint8, seed=4)
            # torch memory: staged by alignment, or (when torch's allocation happens to
            # land on a 512-byte boundary in 4 KiB pages) by small_pages: not this test's
            # subject, so the read's stagings are counted from here
            assert await b.put(_key(1), val)
            before = b.stats()["small_page_stagings"]
            taken = record_takes(b)
            assert await b.get_into(_key(1), out)
            assert same_bits(out, val)
            assert b.stats()["small_page_stagings"] == before  # the read: none
            assert max(taken) < 64 * 1024, taken
        finally:
            await b.close()

    run(body())


def test_auto_follows_the_device(tmp_path: Path) -> None:
    async def body() -> None:
        b = _backend(tmp_path / "t", "auto")
        await b.start()
        try:
            limit = small_page_request_bytes(os.stat(b.root).st_dev)
            if not huge_pages_available():
                limit = None
            assert b.stats()["stage_small_pages"] is (limit is not None)
            assert b.stats()["stage_small_pages_over_bytes"] == (limit or 0)
        finally:
            await b.close()

    run(body())


def test_small_pages_option_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="small_pages"):
        DiskBackend({"path": str(tmp_path / "t"), "small_pages": "sometimes"})


def test_small_tensors_go_direct_below_the_request_limit(tmp_path: Path) -> None:
    """A tensor no larger than what one request carries from small pages is not split,
    so it is used directly even where larger ones are staged."""
    _need_pagemap_scan()

    async def body() -> None:
        b = _backend(tmp_path / "t", "stage")
        await b.start()
        try:
            b._io.stage_small_pages = MiB  # as auto sets it on a device that splits
            for n, staged in ((MiB, 0), (2 * MiB, 1)):
                val = random_tensor((n,), torch.uint8, seed=n)
                assert await b.put(_key(n), val)
                before = b.stats()["small_page_stagings"]
                out = small_pages(n, seed=n)
                assert await b.get_into(_key(n), out)
                assert same_bits(out, val)
                assert b.stats()["small_page_stagings"] - before == staged
        finally:
            await b.close()

    run(body())


@pytest.mark.parametrize(
    ("setting", "want"),
    [("always [madvise] never\n", True), ("[always] madvise never\n", True),
     ("always madvise [never]\n", False)],
)  # fmt: skip
def test_huge_pages_available_reads_the_thp_setting(
    tmp_path: Path, setting: str, want: bool
) -> None:
    d = tmp_path / "kernel" / "mm" / "transparent_hugepage"
    d.mkdir(parents=True)
    (d / "enabled").write_text(setting)
    assert huge_pages_available(str(tmp_path)) is want
    assert huge_pages_available(str(tmp_path / "nowhere")) is False


def test_auto_stages_heap_like_memory_and_keeps_page_aligned_mappings_direct(
    tmp_path: Path,
) -> None:
    """``auto``: a small-page tensor starting inside a page (as a ``malloc`` heap hands
    them out) is staged; one starting on a page boundary (a mapping of its own, such as
    the connector's buffers) goes direct."""
    _need_pagemap_scan()

    async def body() -> None:
        b = _backend(tmp_path / "t", "direct")
        await b.start()
        try:
            align = b.stats()["direct_io_mem_align"]
            if align > 512:
                pytest.skip(f"O_DIRECT needs {align}-byte aligned memory here: no such tensor")
            b._io.stage_small_pages = MiB  # what auto sets on a device that splits
            b._io.stage_page_aligned = False
            val = random_tensor((N,), torch.uint8, seed=9)
            assert await b.put(_key(9), val)
            page_aligned = small_pages(N, seed=3)
            inside = small_pages(N + 4096, seed=4)[512 : 512 + N]
            for out, staged in ((page_aligned, 0), (inside, 1)):
                before = b.stats()["small_page_stagings"]
                assert await b.get_into(_key(9), out)
                assert same_bits(out, val)
                assert b.stats()["small_page_stagings"] - before == staged
        finally:
            await b.close()

    run(body())
