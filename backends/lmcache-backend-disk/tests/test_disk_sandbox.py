"""The disk tier's sandbox and degraded modes: group sharing applies the mode to every file
the tier creates under a 077 umask (and two real users share a tier through a group), a
read-only or full filesystem gives a clear start error and never a raise from ``remove``,
planted FIFOs, hard links and files in the way are handled, the link-free resolution works
without ``openat2`` too, and idle staging buffers are bounded and released."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_testutil import object_files, run
from lmcache_backend_disk import DiskBackend, DiskTierError, sandbox
from lmcache_backend_disk import backend as backend_mod
from lmcache_backend_disk.aligned import BufferPool
from lmcache_backend_disk.layout import INDEX_FILE, META_DIR

from lmcache_core import CacheEngineKey, Namespace
from lmcache_core.testing import random_tensor, same_bits

NS = Namespace(model_name="sandbox", kv_dtype="uint8", block_size=16)
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount, chown, setuid)")


def _b(root: Path | str, **opts: Any) -> DiskBackend:
    return DiskBackend({"path": str(root), "max_bytes": "64MiB", **opts}, namespace=NS)


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("sandbox", 1, 0, i + 1, "uint8")


def _val(i: int, n: int = 5000) -> torch.Tensor:
    return random_tensor((n,), torch.uint8, seed=i)


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            p = os.path.join(dirpath, name)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


# ----------------------------------------------------------------------------- group sharing
def test_group_mode_applies_to_every_file_under_a_077_umask(tmp_path: Path) -> None:
    root = tmp_path / "tier"

    async def body() -> None:
        b = _b(root, mode="0660")
        await b.start()
        try:
            assert all(
                await b.batched_put([_key(i) for i in range(3)], [_val(i) for i in range(3)])
            )
            assert b.pin(_key(0)) is not None
            modes = _modes(root)  # while open: owner file, -wal and -shm exist
        finally:
            await b.close()
        for f in (INDEX_FILE, f"{INDEX_FILE}-wal", f"{INDEX_FILE}-shm", "index.lock"):
            assert modes[f"{META_DIR}/{f}"] == 0o660, (f, oct(modes[f"{META_DIR}/{f}"]))
        owners = [r for r in modes if r.startswith(f"{META_DIR}/owners/")]
        assert owners and all(modes[r] == 0o660 for r in owners)
        for rel, mode in modes.items():
            isdir = (root / rel).is_dir()
            assert mode == (0o770 if isdir else 0o660), (rel, oct(mode))
        assert stat.S_IMODE(root.stat().st_mode) == 0o770

    old = os.umask(0o077)
    try:
        run(body())
    finally:
        os.umask(old)


def _fork_as(uid: int, body: Any) -> tuple[int, Any, int]:
    """Run ``await body(say, wait)`` in a child process as ``uid`` (group 4243, umask 077);
    returns (pid, its output as a file, the fd to send it a line)."""
    r_out, w_out = os.pipe()
    r_in, w_in = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r_out)
            os.close(w_in)
            os.setgroups([4243])
            os.setgid(4243)
            os.setuid(uid)
            os.umask(0o077)

            def say(obj: Any) -> None:
                os.write(w_out, (json.dumps(obj) + "\n").encode())

            def wait() -> None:
                os.read(r_in, 1)

            say(asyncio.run(body(say, wait)))
            code = 0
        except BaseException as exc:
            os.write(w_out, (json.dumps({"error": repr(exc)}) + "\n").encode())
        finally:
            os._exit(code)
    os.close(w_out)
    os.close(r_in)
    return pid, os.fdopen(r_out), w_in


@ROOT_ONLY
def test_two_users_share_a_group_tier_under_a_077_umask() -> None:
    """Users 4242 and 4245 (group 4243, umask 077) share a root-owned 2770 tier: each reads
    what the other stored while both are open."""
    base = Path("/tmp") / f"lmcache-share-{os.getpid()}"
    base.mkdir(mode=0o711)
    root = base / "tier"
    root.mkdir()
    os.chown(root, 0, 4243)
    os.chmod(root, 0o2770)

    async def reads(b: DiskBackend, lo: int) -> int:
        return sum([same_bits(await b.get(_key(i)), _val(i)) for i in range(lo, lo + 4)])

    async def user_a(say: Any, wait: Any) -> dict[str, int]:
        b = _b(root, mode="0660")
        await b.start()
        try:
            assert all(
                await b.batched_put([_key(i) for i in range(4)], [_val(i) for i in range(4)])
            )
            say({"ready": 1})
            await asyncio.to_thread(wait)
            return {"read": await reads(b, 4)}
        finally:
            await b.close()

    async def user_b(say: Any, wait: Any) -> dict[str, int]:
        b = _b(root, mode="0660")
        await b.start()
        try:
            got = await reads(b, 0)
            assert all(
                await b.batched_put([_key(i) for i in range(4, 8)], [_val(i) for i in range(4, 8)])
            )
            await b.reconcile()
            return {"read": got}
        finally:
            await b.close()

    try:
        pid_a, out_a, go_a = _fork_as(4242, user_a)
        assert json.loads(out_a.readline()) == {"ready": 1}
        pid_b, out_b, _ = _fork_as(4245, user_b)
        assert json.loads(out_b.readline()) == {"read": 4}
        assert os.waitpid(pid_b, 0)[1] == 0
        os.write(go_a, b"g")
        assert json.loads(out_a.readline()) == {"read": 4}
        assert os.waitpid(pid_a, 0)[1] == 0
        owners = {os.lstat(os.path.join(d, f)).st_uid for d, _, fs in os.walk(root) for f in fs}
        assert {4242, 4245} <= owners
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


# ----------------------------------------------------------------------------- read-only, full
@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def test_read_only_filesystem(tmpfs: Path) -> None:
    """A directory of the tier turned read-only under a running backend (a read-only bind
    mount: the kernel's EROFS), then the whole tier read-only for a starting one."""
    root = tmpfs / "tier"
    view = tmpfs.parent / "ro-view"
    view.mkdir()
    mounted: list[Path] = []

    async def body() -> None:
        b = _b(root)
        await b.start()
        try:
            assert await b.put(_key(0), _val(0))
            ns = root / b._rel(_key(0)).split("/")[0]
            _mount("--bind", str(ns), str(ns))
            mounted.append(ns)
            _mount("-o", "remount,bind,ro", str(ns))
            assert await b.remove(_key(0)) is False  # no raise
            assert b.stats()["remove_failures"] == 1
            assert same_bits(await b.get(_key(0)), _val(0))  # reads go on
            assert await b.put(_key(2), _val(2)) is False  # a soft failure
        finally:
            await b.close()
        _mount("--bind", str(tmpfs), str(view))
        mounted.append(view)
        _mount("-o", "remount,bind,ro", str(view))
        for path in (view / "tier", view / "new-tier"):
            fresh = _b(path)
            with pytest.raises(DiskTierError, match="read-only"):
                await fresh.start()

    try:
        run(body())
    finally:
        for m in reversed(mounted):
            subprocess.run(["umount", "-l", str(m)], check=False)


def test_full_filesystem_at_start(tmpfs: Path) -> None:
    filler = tmpfs / "filler"
    with open(filler, "wb") as f:
        try:
            f.write(b"\0" * (4 << 20))
        except OSError:
            pass

    async def body() -> None:
        b = _b(tmpfs / "tier")
        with pytest.raises(DiskTierError, match="full"):
            await b.start()

    run(body())
    filler.unlink()

    async def again() -> None:  # room again: it starts
        b = _b(tmpfs / "tier")
        await b.start()
        assert await b.put(_key(0), _val(0))
        await b.close()

    run(again())


# ----------------------------------------------------------------------------- planted things
def test_a_fifo_at_an_object_path_is_a_miss_not_a_hang(tmp_path: Path) -> None:
    root = tmp_path / "tier"

    async def body() -> None:
        b = _b(root)
        await b.start()
        try:
            assert await b.put(_key(0), _val(0))
            path = root / b._rel(_key(0))
            path.unlink()
            os.mkfifo(path)
            got = await asyncio.wait_for(b.get(_key(0)), 10)
            assert got is None and not await b.contains(_key(0))
            assert b.stats()["bad_objects"] == 1
            assert await b.put(_key(0), _val(0))  # replaced by a real object
            assert same_bits(await b.get(_key(0)), _val(0))
        finally:
            await b.close()

    run(body())


def test_hard_linked_index_files_are_not_written_through(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")

    async def body() -> None:
        b = _b(root)
        await b.start()
        await b.put(_key(0), _val(0))
        await b.close()
        wal = root / META_DIR / f"{INDEX_FILE}-wal"
        if wal.exists():
            wal.unlink()
        os.link(outside, wal)
        b2 = _b(root)
        await b2.start()
        try:
            assert await b2.put(_key(1), _val(1))
            assert same_bits(await b2.get(_key(0)), _val(0))
        finally:
            await b2.close()

    run(body())
    assert outside.read_text() == "precious" and os.stat(outside).st_nlink == 1


def test_files_where_directories_belong_are_replaced(tmp_path: Path) -> None:
    root = tmp_path / "tier"

    async def body() -> None:
        b = _b(root)
        await b.start()
        try:
            rel = b._rel(_key(0))
            ns, s1, _name = rel.split("/")
            (root / ns).mkdir(parents=True, exist_ok=True)
            (root / ns / s1).write_text("junk")  # a file where a shard directory belongs
            assert await b.put(_key(0), _val(0))
            assert same_bits(await b.get(_key(0)), _val(0))
            assert (root / ns / s1).is_dir()
        finally:
            await b.close()

    run(body())


def test_without_openat2_the_walk_refuses_links_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandbox, "USE_OPENAT2", False)
    root = tmp_path / "tier"
    elsewhere = tmp_path / "elsewhere"

    async def body() -> None:
        b = _b(root)
        await b.start()
        try:
            assert not b.tier._fast
            assert await b.put(_key(0), _val(0))
            ns, s1, name = b._rel(_key(0)).split("/")
            elsewhere.mkdir(parents=True)
            os.replace(root / ns / s1 / name, elsewhere / name)
            (root / ns / s1).rmdir()
            (root / ns / s1).symlink_to(elsewhere)  # the object is now behind a link
            # the index still lists it (a lookup may say "stored"), but the load refuses
            # the link: a miss, the row dropped and the link (not its target) removed
            assert await b.get(_key(0)) is None
            assert not await b.contains(_key(0))
            assert (elsewhere / name).exists() and not (root / ns / s1).is_symlink()
        finally:
            await b.close()

    run(body())


def test_tierdir_rejects_paths_that_are_not_plain(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    t = sandbox.TierDir(fd, str(tmp_path))
    try:
        for bad in ("../x", "/etc/passwd", "a/../../x", "a//b", "./a"):
            with pytest.raises((ValueError, OSError)):
                t.open(bad, os.O_RDONLY)
    finally:
        t.close()


# ----------------------------------------------------------------------------- staging
def test_buffer_pool_is_bounded_and_released_when_idle() -> None:
    pool = BufferPool(3 * 4096, idle_seconds=60.0)
    bufs = [pool.take(4096) for _ in range(5)]
    for buf in bufs:
        pool.give(buf)
    assert pool.idle_bytes == 3 * 4096  # the bound
    again = pool.take(4096)
    assert again in bufs[2:]  # reused, most recent first
    pool.give(again)
    assert pool.release_idle(now=time.monotonic() + 61) == 3 * 4096
    assert pool.idle_bytes == 0
    pool.clear()
    pool.give(pool.take(4096))  # after clear: released at once
    assert pool.idle_bytes == 0


def test_backend_staging_buffers_are_released_when_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend_mod, "STAGING_IDLE_S", 0.3)

    async def body() -> None:
        b = _b(tmp_path / "tier", direct_io="auto", staging_bytes="2MiB")
        await b.start()
        try:
            if not b.direct_io:
                pytest.skip("the filesystem refuses O_DIRECT: no staging buffers")
            vals = [torch.empty(600_000, dtype=torch.uint8)[1:] for _ in range(8)]  # unaligned
            assert all(await b.batched_put([_key(i) for i in range(8)], vals))
            assert 0 < b.stats()["staging_idle_bytes"] <= 2 << 20
            await asyncio.sleep(1.0)
            assert b.stats()["staging_idle_bytes"] == 0
            assert len(object_files(str(tmp_path / "tier"))) == 8
        finally:
            await b.close()

    run(body())
