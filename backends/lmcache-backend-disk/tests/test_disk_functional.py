"""Functional tests of the disk tier: layout, permissions, format, identity, I/O paths,
persistence of the LRU order, the shared bound, read leases, recovery and maintenance."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import sqlite3
import stat
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_testutil import (
    finish_worker,
    object_files,
    record_takes,
    run,
    start_worker,
    temp_files,
)
from lmcache_backend_disk import DiskBackend, DiskOptions, aligned_empty
from lmcache_backend_disk import backend as backend_mod
from lmcache_backend_disk.layout import INDEX_FILE, META_DIR, NAMESPACE_FILE, OWNERS_DIR
from safetensors import safe_open

from lmcache_core import CacheEngineKey, Namespace
from lmcache_core.config.options import describe_options
from lmcache_core.errors import BufferMismatchError, ConfigError
from lmcache_core.plugins import get_registry
from lmcache_core.testing import random_tensor, same_bits

MiB = 1 << 20
NS = Namespace(model_name="functional", kv_dtype="float16", block_size=16)


def _b(root: Path | str, namespace: Namespace | None = NS, **opts: Any) -> DiskBackend:
    return DiskBackend({"path": str(root), "max_bytes": "256MiB", **opts}, namespace=namespace)


def _key(i: int, model: str = "functional") -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, i + 1, "float16")


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ----------------------------------------------------------------------------- registration
def test_registered_as_disk_with_file_scheme() -> None:
    spec = get_registry().get("disk")
    assert spec.load() is DiskBackend
    assert get_registry().for_scheme("file").name == "disk"


def test_options_are_declared_and_validated(tmp_path: Path) -> None:
    names = [o["name"] for o in describe_options(DiskOptions)]
    assert names[:2] == ["path", "max_bytes"] and "direct_io" in names and "mode" in names
    with pytest.raises(ConfigError, match="path"):
        DiskBackend({})
    with pytest.raises(ConfigError, match="mode"):
        DiskBackend({"path": str(tmp_path), "mode": "rw"})
    with pytest.raises(ConfigError, match="mode"):
        DiskBackend({"path": str(tmp_path), "mode": "0400"})
    with pytest.raises(ConfigError, match="direct_io"):
        DiskBackend({"path": str(tmp_path), "direct_io": "sometimes"})
    b = DiskBackend({"path": str(tmp_path / "never-created"), "max_bytes": "2GiB"})
    assert b.max_bytes == 2 << 30
    assert not (tmp_path / "never-created").exists(), "the constructor must do no I/O"


# ----------------------------------------------------------------------------- layout
def test_layout_permissions_and_safetensors_format(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    key = _key(1)
    value = random_tensor((3, 4, 5), torch.float16, seed=1)

    async def body() -> None:
        b = _b(root)
        await b.start()
        try:
            assert await b.put(key, value)
            path = os.path.join(b.root, b._rel(key))
        finally:
            await b.close()
        rel = os.path.relpath(path, root)
        ns_dir, shard, name = rel.split(os.sep)
        assert ns_dir.startswith("ns2-") and name == key.to_path().split("/")[-1]
        assert shard == name[:2]
        assert _mode(path) == 0o600
        for d in (root, root / ns_dir, root / ns_dir / shard, root / META_DIR):
            assert _mode(str(d)) == 0o700, d
        assert _mode(str(root / META_DIR / INDEX_FILE)) == 0o600
        with open(root / ns_dir / NAMESPACE_FILE) as f:
            assert json.load(f) == {"namespace": NS.to_json()}
        with safe_open(path, framework="pt") as f:
            assert same_bits(f.get_tensor("kv"), value)
            meta = f.metadata()
        assert meta["key"] == key.to_string() and meta["namespace"] == NS.to_json()
        assert meta["checksum"].startswith("xxh3_128:")
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
        assert (8 + n) % 4096 == 0, "data region must start on a 4096-byte boundary"

    run(body())


@pytest.mark.parametrize("direct", ["true", "false"])
def test_objects_larger_than_a_write_piece_are_whole_and_checksummed(
    tmp_path: Path, direct: str
) -> None:
    """Direct writes of objects over one 4 MiB piece go piece by piece with the header
    (and its checksum over every piece) last: from plain and aligned sources, with
    sizes that end mid-block, the file is exactly header + data, safetensors reads the
    tensor back, and reads into plain and aligned buffers and into new tensors are
    bit-exact. A flipped byte in any piece is caught by the checksum."""
    from lmcache_backend_disk import objects as objects_mod

    sizes = [objects_mod.WRITE_PIECE + 1, 2 * objects_mod.WRITE_PIECE, 9 * MiB + 4096 + 7]

    async def body() -> None:
        b = _b(tmp_path / "tier", direct_io=direct)
        await b.start()
        try:
            keys = [_key(100 + i) for i in range(2 * len(sizes))]
            vals = []
            for i, n in enumerate(sizes):
                v = random_tensor((n,), torch.uint8, seed=40 + i)
                a = aligned_empty((n,), torch.uint8)
                a.copy_(random_tensor((n,), torch.uint8, seed=80 + i))
                vals += [v, a]
            assert all(await b.batched_put(keys, vals))
            for k, v in zip(keys, vals, strict=True):
                path = os.path.join(b.root, b._rel(k))
                with open(path, "rb") as f:
                    hlen = 8 + int.from_bytes(f.read(8), "little")
                assert os.path.getsize(path) == hlen + v.numel()
                with safe_open(path, framework="pt") as f:
                    assert same_bits(f.get_tensor("kv"), v)
                got = await b.get(k)
                assert got is not None and same_bits(got, v)
                for out in (torch.empty_like(v), aligned_empty(v.shape, v.dtype)):
                    assert await b.get_into(k, out)
                    assert same_bits(out, v)
            # corrupt one byte in the second piece of the first object: a miss
            path = os.path.join(b.root, b._rel(keys[0]))
            with open(path, "r+b") as f:
                hlen = 8 + int.from_bytes(f.read(8), "little")
                f.seek(hlen + objects_mod.WRITE_PIECE)
                byte = f.read(1)
                f.seek(hlen + objects_mod.WRITE_PIECE)
                f.write(bytes([byte[0] ^ 0x40]))
            assert await b.get(keys[0]) is None
        finally:
            await b.close()

    run(body())


def test_mode_option_shares_with_a_group(tmp_path: Path) -> None:
    async def body() -> None:
        b = _b(tmp_path / "tier", mode="0640")
        await b.start()
        try:
            assert await b.put(_key(1), random_tensor((8,)))
            path = os.path.join(b.root, b._rel(_key(1)))
        finally:
            await b.close()
        assert _mode(path) == 0o640
        assert _mode(os.path.dirname(path)) == 0o750

    old = os.umask(0o077)  # the option wins over a restrictive umask
    try:
        run(body())
    finally:
        os.umask(old)


def test_hostile_key_text_stays_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    keys = [
        CacheEngineKey("../../../../etc/passwd", 1, 0, 1, "../x"),
        CacheEngineKey("/abs/path", 1, 0, 2, "f16", tags={"..": "/.."}),
        CacheEngineKey("a\x00b@c%d", 1, 0, 3, "\n"),
    ]

    async def body() -> None:
        b = _b(root)
        await b.start()
        try:
            for i, k in enumerate(keys):
                assert await b.put(k, random_tensor((16,), seed=i))
            for i, k in enumerate(keys):
                assert same_bits(await b.get(k), random_tensor((16,), seed=i))
        finally:
            await b.close()

    run(body())
    real_root = os.path.realpath(root)
    for dirpath, _dirs, files in os.walk(tmp_path):
        for f in files:
            assert os.path.realpath(os.path.join(dirpath, f)).startswith(real_root + os.sep)
    assert len(object_files(str(root))) == 3


def test_namespaces_are_isolated(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    other_ns = Namespace(model_name="functional", kv_dtype="float16", block_size=32)
    key = _key(7)
    va, vb = random_tensor((64,), seed=1), random_tensor((64,), seed=2)

    async def body() -> None:
        a, b, none = _b(root), _b(root, other_ns), _b(root, None)
        for x in (a, b, none):
            await x.start()
        try:
            assert await a.put(key, va)
            assert await b.get(key) is None and await none.get(key) is None
            assert await b.put(key, vb)
            assert same_bits(await a.get(key), va) and same_bits(await b.get(key), vb)
            assert a.stats()["bad_objects"] == b.stats()["bad_objects"] == 0
            assert len(await a.namespaces()) == 2
        finally:
            for x in (a, b, none):
                await x.close()

    run(body())


# ----------------------------------------------------------------------------- I/O paths
@pytest.mark.parametrize("direct_io", ["true", "false"])
def test_io_paths_round_trip(tmp_path: Path, direct_io: str) -> None:
    """Aligned and unaligned outputs, tails that are not a block multiple, empty tensors."""
    sizes = [0, 1, 4095, 4096, 4097, 3 * MiB + 17, 4 * MiB]

    async def body() -> None:
        b = _b(tmp_path / "tier", direct_io=direct_io)
        await b.start()
        try:
            assert b.direct_io is (direct_io == "true")
            keys = [_key(i) for i in range(len(sizes))]
            vals = [random_tensor((n,), torch.uint8, seed=n) for n in sizes]
            for parity in (0, 1):  # half the values from aligned memory, then the other half
                sources = [aligned_empty(v.shape, v.dtype).copy_(v) if i % 2 == parity else v
                           for i, v in enumerate(vals)]  # fmt: skip
                assert all(await b.batched_put(keys, sources))
                for k, v in zip(keys, vals, strict=True):
                    aligned = aligned_empty(v.shape, v.dtype)
                    assert aligned.data_ptr() % 4096 == 0
                    plain = torch.empty(v.numel() + 1, dtype=torch.uint8)[1:]  # surely unaligned
                    for out in (aligned, plain):
                        out.fill_(0) if out.numel() else None
                        assert await b.get_into(k, out)
                        assert same_bits(out, v)
                    assert same_bits(await b.get(k), v)
            outs = [aligned_empty(v.shape, v.dtype) for v in vals]
            assert await b.batched_get_into(keys, outs) == [True] * len(keys)
            assert all(same_bits(o, v) for o, v in zip(outs, vals, strict=True))
        finally:
            await b.close()

    run(body())


async def _twelve_stored(
    b: DiskBackend,
) -> tuple[list[CacheEngineKey], list[torch.Tensor], list[torch.Tensor]]:
    """Store 12 values of ~256 KiB; their keys, the values and zeroed load buffers
    (aligned and plain in turn)."""
    keys = [_key(i) for i in range(12)]
    vals = [random_tensor((256 * 1024 + 4 * i,), torch.uint8, seed=i) for i in range(12)]
    assert all(await b.batched_put(keys, vals))
    outs = [
        aligned_empty(v.shape, v.dtype) if i % 2 else torch.empty_like(v)
        for i, v in enumerate(vals)
    ]
    for o in outs:
        o.zero_()
    return keys, vals, outs


@pytest.mark.parametrize("limit", [1, 2])
def test_reads_in_flight_bounds_the_device_reads_of_a_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """A batch of cold reads (aligned and plain buffers) issues at most
    ``reads_in_flight`` data reads at once, every value bit-exact; the pool's other
    threads wait for a turn rather than piling requests onto the device. (The turns'
    Python path, where each read goes through ``os.preadv`` and can be counted; the
    compiled read queue is checked by the next test and ``tests/test_turns.py``.)"""
    import threading
    import time

    from lmcache_backend_disk import objects as objects_mod

    from lmcache_core import turns as turns_mod

    monkeypatch.setattr(turns_mod, "_native", None)
    real = os.preadv
    lock = threading.Lock()
    now, peak, big = [0], [0], [0]

    def counting(fd: int, views: Any, offset: int) -> int:
        size = sum(len(v) for v in views)
        if size < 64 * 1024:  # headers and bounce blocks
            return real(fd, views, offset)
        with lock:
            now[0] += 1
            big[0] += 1
            peak[0] = max(peak[0], now[0])
        try:
            time.sleep(0.005)  # long enough for the other pool threads to pile up
            return real(fd, views, offset)
        finally:
            with lock:
                now[0] -= 1

    async def body() -> None:
        b = _b(tmp_path / "tier", direct_io="true", reads_in_flight=limit)
        await b.start()
        try:
            assert b._io._read_turns is not None and not b._io._read_turns.native
            keys, vals, outs = await _twelve_stored(b)
            monkeypatch.setattr(objects_mod.os, "preadv", counting)
            assert await b.batched_get_into(keys, outs) == [True] * 12
            assert all(same_bits(o, v) for o, v in zip(outs, vals, strict=True))
        finally:
            monkeypatch.setattr(objects_mod.os, "preadv", real)
            await b.close()

    run(body())
    assert big[0] >= 12
    assert peak[0] == limit


@pytest.mark.parametrize("limit", [1, 2])
def test_the_compiled_read_queue_serves_the_data_reads_of_a_batch(
    tmp_path: Path, limit: int
) -> None:
    """Where lmcache_core's compiled module was built, a batch's data reads go through
    the tier's read queue (at most ``reads_in_flight`` reader threads, each with one
    read on the device), bit-exact into aligned and plain buffers."""
    import threading

    from lmcache_core import turns as turns_mod

    if turns_mod._native is None:
        pytest.skip("lmcache_core._speedups was not built (no C compiler at install)")
    peak = {"reading": 0, "threads": 0}
    done = threading.Event()

    async def body() -> None:
        b = _b(tmp_path / "tier", direct_io="true", reads_in_flight=limit)
        await b.start()
        turns = b._io._read_turns
        assert turns is not None and turns.native

        def sampler() -> None:
            while not done.is_set():
                s = turns.stats()
                peak["reading"] = max(peak["reading"], int(s["reading"]))
                peak["threads"] = max(peak["threads"], int(s["threads"]))

        watch = threading.Thread(target=sampler)
        try:
            keys, vals, outs = await _twelve_stored(b)
            before = int(turns.stats()["reads"])
            watch.start()
            assert await b.batched_get_into(keys, outs) == [True] * 12
            assert all(same_bits(o, v) for o, v in zip(outs, vals, strict=True))
            assert int(turns.stats()["reads"]) - before >= 12
        finally:
            done.set()
            if watch.is_alive():
                watch.join()
            await b.close()

    run(body())
    assert 1 <= peak["threads"] <= limit
    assert peak["reading"] <= limit


def test_buffers_aligned_to_the_devices_dma_alignment_go_direct(tmp_path: Path) -> None:
    """Where the filesystem reports (``statx``) and the probe confirms a memory alignment
    finer than 4096 (512 on this machine's virtio disk, 4 on NVMe), tensors aligned to it
    but not to 4096 are written from and read into directly (no object-sized staging
    buffer), bit-exact; coarser-misaligned ones still go through staging. (``small_pages``
    ``direct``: the buffer is partly in 4 KiB pages, which ``auto`` stages on a virtio
    disk; tested below.)"""

    async def body() -> None:
        b = _b(tmp_path / "tier", direct_io="true", small_pages="direct")
        await b.start()
        try:
            align = b.stats()["direct_io_mem_align"]
            assert align in (4096,) or (align < 4096 and align & (align - 1) == 0)
            if align == 4096:
                pytest.skip("this filesystem reports no O_DIRECT alignment finer than 4096")
            n = 3 * MiB + 4096
            area = aligned_empty((n + 2 * 4096,), torch.uint8)
            fine = area[align : align + n]  # aligned to `align`, not to 4096
            assert fine.data_ptr() % align == 0 and fine.data_ptr() % 4096 != 0
            val = random_tensor((n,), torch.uint8, seed=5)
            taken = record_takes(b)
            fine.copy_(val)
            assert await b.put(_key(7), fine)
            fine.fill_(0)
            assert await b.get_into(_key(7), fine)
            assert same_bits(fine, val)
            assert taken and max(taken) < 64 * 1024, taken  # bounce blocks only
            taken.clear()
            coarse = area[align // 2 : align // 2 + n] if align >= 128 else None
            if coarse is not None:  # misaligned for O_DIRECT: staged, still exact
                assert await b.get_into(_key(7), coarse)
                assert same_bits(coarse, val)
                assert max(taken) >= n
        finally:
            await b.close()

    run(body())


def test_direct_io_falls_back_when_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem refusing O_DIRECT (the probe fails): ``auto`` falls back to buffered
    I/O, ``true`` refuses to start."""
    monkeypatch.setattr(backend_mod, "probe_direct_io", lambda *a: False)

    async def body() -> None:
        b = _b(tmp_path / "auto")
        await b.start()
        try:
            assert b.direct_io is False
            assert await b.put(_key(1), random_tensor((5000,)))
            assert same_bits(await b.get(_key(1)), random_tensor((5000,)))
        finally:
            await b.close()
        strict = _b(tmp_path / "strict", direct_io="true")
        with pytest.raises(ConfigError, match="O_DIRECT"):
            await strict.start()
        await strict.close()
        assert os.listdir(tmp_path / "strict" / META_DIR / OWNERS_DIR) == []

    run(body())


def test_wrong_buffer_raises_and_keeps_the_object(tmp_path: Path) -> None:
    async def body() -> None:
        b = _b(tmp_path / "tier")
        await b.start()
        try:
            v = random_tensor((4, 8), torch.float16, seed=3)
            assert await b.put(_key(1), v)
            with pytest.raises(BufferMismatchError):
                await b.get_into(_key(1), torch.empty((4, 9), dtype=torch.float16))
            with pytest.raises(BufferMismatchError):
                await b.get_into(_key(1), torch.empty((4, 8), dtype=torch.bfloat16))
            assert same_bits(await b.get(_key(1)), v)
            assert b.stats()["bad_objects"] == 0
        finally:
            await b.close()

    run(body())


def test_buffered_durable_off_still_round_trips(tmp_path: Path) -> None:
    async def body() -> None:
        b = _b(tmp_path / "tier", fsync=False, io_nice=0, concurrency=2)
        await b.start()
        try:
            keys = [_key(i) for i in range(20)]
            vals = [random_tensor((1000 + i,), seed=i) for i in range(20)]
            assert all(await b.batched_put(keys, vals))
            got = await b.batched_get(keys)
            assert all(same_bits(g, v) for g, v in zip(got, vals, strict=True))
        finally:
            await b.close()

    run(body())


# ----------------------------------------------------------------------------- bound and LRU
def test_lru_order_persists_across_reopen(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    chunk = random_tensor((MiB,), torch.uint8, seed=0)

    cap = 4 * (MiB + 4096)  # four objects (data + a 4 KiB header each)

    async def body() -> None:
        b = _b(root, max_bytes=cap, touch_interval=0)
        await b.start()
        for i in range(3):
            assert await b.put(_key(i), chunk)
        assert await b.get(_key(0)) is not None  # 0 becomes the most recently used
        await b.close()
        b2 = _b(root, max_bytes=cap)
        await b2.start()
        try:
            assert await b2.put(_key(3), chunk)
            assert await b2.put(_key(4), chunk)  # must evict 1 (oldest), not 0
            present = await b2.batched_contains([_key(i) for i in range(5)])
            assert present == [True, False, True, True, True]
            assert b2.stats()["used_bytes"] <= cap
        finally:
            await b2.close()

    run(body())


def test_bound_is_shared_between_instances(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    chunk = random_tensor((MiB,), torch.uint8, seed=0)

    async def body() -> None:
        a, b = _b(root, max_bytes=5 * MiB), _b(root, max_bytes=5 * MiB)
        await a.start()
        await b.start()
        try:
            for i in range(4):
                assert await a.put(_key(i), chunk)
            for i in range(4, 8):
                assert await b.put(_key(i), chunk)
            files = object_files(str(root))
            assert sum(files.values()) <= 5 * MiB and len(files) == 4
            assert (await a.usage())["used_bytes"] == sum(files.values())
            assert a.stats()["evictions"] == 0 and b.stats()["evictions"] == 4
            assert await a.batched_contains([_key(i) for i in range(8)]) == [False] * 4 + [True] * 4
        finally:
            await a.close()
            await b.close()

    run(body())


def test_entry_being_read_is_never_evicted(tmp_path: Path) -> None:
    """A reader holds a shared lock on the file it reads; an evictor skips such files and
    refuses a store softly when nothing else can go."""
    root = tmp_path / "tier"
    chunk = random_tensor((MiB,), torch.uint8, seed=0)

    async def body() -> None:
        b = _b(root, max_bytes=3 * MiB)
        await b.start()
        try:
            for i in range(2):
                assert await b.put(_key(i), chunk)
            fds = []
            for i in range(2):  # both entries are "being read" (as a reader's flock does)
                fd = os.open(os.path.join(b.root, b._rel(_key(i))), os.O_RDONLY)
                fcntl.flock(fd, fcntl.LOCK_SH)
                fds.append(fd)
            try:
                assert await b.put(_key(2), chunk) is False
                assert b.stats()["full_rejections"] == 1
                os.close(fds.pop(0))  # reading of key 0 is over
                assert await b.put(_key(2), chunk)
                present = await b.batched_contains([_key(i) for i in range(3)])
                assert present == [False, True, True], "only the entry no longer read may go"
            finally:
                for fd in fds:
                    os.close(fd)
        finally:
            await b.close()

    run(body())


# ----------------------------------------------------------------------------- recovery
def test_leftovers_of_a_dead_writer_are_cleaned_and_a_live_ones_kept(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    chunk = random_tensor((MiB,), torch.uint8, seed=0)

    async def body() -> None:
        def half_write(b: DiskBackend, key: CacheEngineKey) -> str:
            w = b._plan(key, chunk)
            b._reserve_sync([w])
            assert w.pending_id is not None
            b._write_sync(w)  # the temporary file is complete but never published
            return os.path.join(b.root, w.tmp)

        live, dying = _b(root), _b(root)
        await live.start()
        await dying.start()
        live_tmp = await live._call(half_write, live, _key(1))
        dead_tmp = await dying._call(half_write, dying, _key(2))
        assert (await live.usage())["used_bytes"] >= 2 * MiB
        # "kill" the dying one: its owner lock goes away with it, its files stay
        assert dying._owner_lock is not None and dying._owner_lock._fd is not None
        os.close(dying._owner_lock._fd)
        dying._owner_lock._fd = None
        dying._exec.shutdown()  # type: ignore[union-attr]
        dying._index.close()  # type: ignore[union-attr]
        fresh = _b(root)
        await fresh.start()
        try:
            assert os.path.exists(live_tmp), "a live writer's temporary file must be kept"
            assert not os.path.exists(dead_tmp), "a dead writer's temporary file must go"
            owners = sorted(os.listdir(root / META_DIR / OWNERS_DIR))
            assert owners == sorted([live.owner, fresh.owner])
            assert fresh.stats()["reaped_owners"] == 1
            usage = await fresh.usage()
            assert MiB <= usage["used_bytes"] < 2 * MiB  # only the live reservation is left
        finally:
            await fresh.close()
            await live.close()

    run(body())


@pytest.mark.parametrize("damage", ["deleted", "garbage"])
def test_lost_or_damaged_index_is_rebuilt(tmp_path: Path, damage: str) -> None:
    root = tmp_path / "tier"
    keys = [_key(i) for i in range(6)]
    vals = [random_tensor((100_000 + i,), torch.uint8, seed=i) for i in range(6)]

    async def body() -> None:
        b = _b(root)
        await b.start()
        assert all(await b.batched_put(keys, vals))
        await b.close()
        index = root / META_DIR / INDEX_FILE
        for suffix in ("", "-wal", "-shm"):
            p = Path(str(index) + suffix)
            if p.exists():
                p.unlink()
        if damage == "garbage":
            index.write_bytes(b"this is not a database" * 100)
        tmp_left = root / os.path.dirname(b._rel(keys[0])) / f".{'0' * 32}.{'f' * 16}.1.tmp"
        tmp_left.write_bytes(b"partial")  # an orphan temp of a writer that never existed
        b2 = _b(root, max_bytes=int(2.5 * 100_000) + 20_000)
        await b2.start()
        try:
            files = object_files(str(root))
            assert not tmp_left.exists()
            assert b2.stats()["entries"] == 6 and b2.stats()["used_bytes"] == sum(files.values())
            for k, v in zip(keys, vals, strict=True):
                assert same_bits(await b2.get(k), v)
            assert await b2.put(_key(10), vals[0])  # eviction works on the rebuilt index
            assert len(object_files(str(root))) <= 2
        finally:
            await b2.close()
        if damage == "garbage":
            assert Path(str(index) + ".corrupt").exists()

    run(body())


def test_reconcile_adopts_orphans_and_drops_phantoms(tmp_path: Path) -> None:
    root = tmp_path / "tier"

    async def body() -> None:
        b = _b(root)
        await b.start()
        try:
            v = random_tensor((5000,), torch.uint8, seed=1)
            assert await b.batched_put([_key(1), _key(2)], [v, v])
            gone = os.path.join(b.root, b._rel(_key(1)))
            os.unlink(gone)  # a row without a file
            with b.index.transaction() as tx:  # a file without a row
                tx.delete_entry(b._rel(_key(2)))
            result = await b.reconcile()
            assert result["adopted"] == 1 and result["dropped_rows"] == 1
            usage = await b.usage()
            assert usage["entries"] == 1
            assert usage["used_bytes"] == sum(object_files(str(root)).values())
        finally:
            await b.close()

    run(body())


# ----------------------------------------------------------------------------- maintenance
def test_scan_verify_delete(tmp_path: Path) -> None:
    root = tmp_path / "tier"

    async def body() -> None:
        b = _b(root)
        await b.start()
        try:
            keys = [_key(i) for i in range(5)]
            vals = [random_tensor((1000 * (i + 1),), seed=i) for i in range(5)]
            assert all(await b.batched_put(keys, vals))
            seen: list[tuple[int, int | None]] = []
            entries = [
                e
                async for e in b.scan(read_headers=True, progress=lambda d, t: seen.append((d, t)))
            ]
            assert len(entries) == 5 and seen[-1] == (5, 5)
            assert {e.key for e in entries} == {k.to_string() for k in keys}
            assert {e.namespace for e in entries} == {NS.to_json()}
            assert sum(e.size for e in entries) == (await b.usage())["used_bytes"]
            assert all([await b.verify_entry(e) for e in entries])
            # a byte flipped in one object: verify catches it without a read having removed it
            victim = entries[0]
            path = os.path.join(b.root, victim.location)
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)[0]
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last ^ 1]))
            assert "checksum" in (await b.check_entry(victim) or "")
            assert await b.delete_entry(victim)
            assert not os.path.exists(path)
            assert (await b.usage())["entries"] == 4
            # a sound object moved to another key's location fails verify
            other = entries[1]
            shutil.copyfile(os.path.join(b.root, other.location), path)
            assert "another key" in (await b.check_entry(victim) or "")
        finally:
            await b.close()

    run(body())


def test_cancelled_batched_put_leaves_no_residue(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    vals = [random_tensor((4 * MiB,), torch.uint8, seed=i) for i in range(8)]

    async def body() -> None:
        b = _b(root)
        await b.start()
        try:
            for delay in (0.0, 0.002, 0.01, 0.05):
                keys = [_key(100 + i) for i in range(8)]
                task = asyncio.ensure_future(b.batched_put(keys, vals))
                await asyncio.sleep(delay)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                assert temp_files(str(root)) == []
                usage = await b.usage()
                assert usage["used_bytes"] == sum(object_files(str(root)).values())
                for k, v in zip(keys, vals, strict=True):
                    got = await b.get(k)
                    assert got is None or same_bits(got, v)
        finally:
            await b.close()

    run(body())


# ----------------------------------------------------------------------------- /dev/shm
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this system")
def test_dev_shm_tier_shared_by_processes() -> None:
    """Two writer processes and a reader process share a tier in /dev/shm (as several
    vLLM instances on one host would): one bound, verified hits across processes."""
    root = f"/dev/shm/lmcache-disk-test-{uuid.uuid4().hex[:12]}"
    try:
        writers = [start_worker("writer", root, 4, 16 * MiB, MiB, s) for s in range(2)]
        reader = start_worker("reader", root, 6, MiB, 5)
        reports = [finish_worker(p, timeout=120) for p in writers]
        read = finish_worker(reader, timeout=120)
        assert read["bad"] == 0 and read["hits"] > 0, read
        assert all(r["stored"] > 0 for r in reports)
        assert sum(object_files(root).values()) <= 16 * MiB
        with open("/proc/mounts") as f:
            fs = [line.split()[2] for line in f if line.split()[1] == "/dev/shm"]
        assert fs[-1:] == ["tmpfs"]
        con = sqlite3.connect(os.path.join(root, META_DIR, INDEX_FILE))
        try:
            used = con.execute("SELECT used FROM totals").fetchone()[0]
        finally:
            con.close()
        assert used == sum(object_files(root).values())
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_row_whose_file_vanished_is_dropped_on_read(tmp_path: Path) -> None:
    """A process killed mid-eviction can leave an index row without its file: the next read
    of that key is a miss and drops the row, so usage stops counting the lost bytes."""

    async def body() -> None:
        b = _b(tmp_path)
        await b.start()
        try:
            keep, gone = _key(1), _key(2)
            value = random_tensor((4096,), torch.float16, seed=1)
            assert await b.put(keep, value)
            assert await b.put(gone, value)
            files = object_files(str(tmp_path))
            assert (await b.usage())["entries"] == 2 == len(files)
            os.unlink(os.path.join(str(tmp_path), b._rel(gone)))  # as an interrupted eviction
            assert (await b.usage())["entries"] == 2
            assert await b.get(gone) is None
            usage = await b.usage()
            assert usage["entries"] == 1
            assert usage["used_bytes"] == sum(object_files(str(tmp_path)).values())
            assert b.stats()["stale_rows_removed"] == 1
            assert await b.get(_key(3)) is None  # a plain miss changes nothing
            assert b.stats()["stale_rows_removed"] == 1
            assert same_bits(await b.get(keep), value)
        finally:
            await b.close()

    run(body())
