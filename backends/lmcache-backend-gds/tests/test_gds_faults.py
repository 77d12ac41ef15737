"""Crash safety and corruption of the gds tier on its POSIX path (real files, real
processes): writers SIGKILLed mid-put, bytes flipped in every region of an object,
truncations, swapped files - all misses or complete old/new values, never wrong data."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from gds_testutil import object_path
from lmcache_backend_gds import GdsBackend

from lmcache_core import format as fmt
from lmcache_core.keys import Namespace
from lmcache_core.testing.contract import make_key, random_tensor, same_bits
from lmcache_core.testing.worker import killed_writer_candidates, shared_key

NS = Namespace(model_name="gds-faults", chunk_size=256)
TARGET = "lmcache_backend_gds.backend:GdsBackend"


def _temps(root: str) -> list[str]:
    return [
        os.path.join(d, f)
        for d, _, files in os.walk(root)
        for f in files
        if f.endswith(".tmp") and ".lmcache-disk" not in d
    ]


def _objects(root: str) -> dict[str, int]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if len(f) == 32 and ".lmcache-disk" not in d:
                p = os.path.join(d, f)
                out[p] = os.path.getsize(p)
    return out


@pytest.mark.parametrize("stripes", [1, 2])
def test_sigkilled_writers_leave_complete_entries_or_nothing(tmp_path: Path, stripes: int) -> None:
    """Writers of 4 MiB objects killed at random instants (20 times): afterwards every key
    is bit-exact to a value once written or absent, the dead writers' temporary files are
    gone after a reopen, and the index agrees with the files."""
    if stripes == 1:
        opts: dict[str, Any] = {"path": str(tmp_path / "tier")}
    else:
        opts = {"paths": [str(tmp_path / "a"), str(tmp_path / "b")]}
    opts["max_bytes"] = "256MiB"
    spec = json.dumps({"target": TARGET, "options": opts})
    worker = os.path.join(os.path.dirname(__file__), "gds_kill_worker.py")
    proc = subprocess.run(
        [sys.executable, worker, spec, "20", str(17 + stripes)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["kills"] == 20
    assert report["left_temps"] > 0, "no kill landed mid-write: the test saw no crash"

    async def check() -> None:
        b = GdsBackend(opts)
        await b.start()
        try:
            for r in b.roots:
                assert _temps(r) == [], "temporary files of dead writers survived a reopen"
            present = 0
            for j in range(4):
                got = await b.get(shared_key(j, "killed"))
                if got is not None:
                    present += 1
                    assert any(same_bits(got, c) for c in killed_writer_candidates(j)), j
            assert present > 0
            files = {p: s for r in b.roots for p, s in _objects(r).items()}
            usage = await b.usage()
            assert usage["entries"] == len(files) == present
            assert usage["used_bytes"] == sum(files.values()), "index disagrees with files"
            async for e in b.scan():
                assert await b.check_entry(e) is None, e.location
            assert b.stats()["bad_objects"] == 0
        finally:
            await b.close()

    asyncio.run(check())


def _regions(raw: bytes) -> dict[str, list[int]]:
    """Byte offsets to flip, by region of the object file."""
    header = fmt.decode_header(raw, total_size=len(raw))
    json_end = 8 + raw[8 : header.data_offset].rstrip(b" ").__len__()
    return {
        "length prefix": [0, 3, 7],
        "json": [8, 20, json_end // 2, json_end - 1],
        "padding": [json_end, (json_end + header.data_offset) // 2, header.data_offset - 1],
        "data": [header.data_offset, header.data_offset + 4096, len(raw) // 2, len(raw) - 1],
    }


def test_flips_in_every_region_truncations_and_swaps_are_misses(tmp_path: Path) -> None:
    root = str(tmp_path / "tier")

    async def body() -> None:
        b = GdsBackend({"path": root, "max_bytes": "64MiB", "force_posix": True}, namespace=NS)
        await b.start()
        try:
            key = make_key("victim")
            value = random_tensor((6, 3001), torch.float16, seed=3)  # a partial last block
            assert await b.put(key, value)
            path = object_path(b, key)
            with open(path, "rb") as f:
                pristine = f.read()
            served = 0

            async def damaged(data: bytes, what: str) -> None:
                nonlocal served
                with open(path, "wb") as f:
                    f.write(data)
                read = served % 3
                served += 1
                if read == 0:
                    assert await b.get(key) is None, what
                elif read == 1:
                    assert not await b.get_into(key, torch.empty_like(value)), what
                else:
                    assert await b.batched_get_into([key], [torch.empty_like(value)]) == [False]
                assert not os.path.exists(path), f"{what}: bad object not removed"
                assert await b.put(key, value)
                assert same_bits(await b.get(key), value)

            for region, offsets in _regions(pristine).items():
                for off in offsets:
                    raw = bytearray(pristine)
                    raw[off] ^= 0x20 if region == "padding" else 0x5A  # space -> NUL etc.
                    await damaged(bytes(raw), f"flip in {region} at {off}")
            for cut in (0, 7, 100, 4095, 4096, 4097, len(pristine) // 2, len(pristine) - 1):
                await damaged(pristine[:cut], f"truncated to {cut}")
            await damaged(pristine + b"\0" * 4096, "extended")
            # swapped: another key's valid object at this key's path
            other = make_key("other")
            assert await b.put(other, value)
            with open(object_path(b, other), "rb") as f:
                await damaged(f.read(), "another key's object")
            assert b.stats()["bad_objects"] == served
        finally:
            await b.close()

    asyncio.run(body())


def test_a_directory_removed_under_a_striped_tier_degrades_to_misses(tmp_path: Path) -> None:
    """One NVMe mount of a striped tier losing its files: its keys miss, the other
    directory's keys still hit, and stores go on."""
    paths = [str(tmp_path / "a"), str(tmp_path / "b")]

    async def body() -> None:
        b = GdsBackend({"paths": paths, "max_bytes": "64MiB"})
        await b.start()
        try:
            keys = [make_key(f"s{i}") for i in range(32)]
            vals = [random_tensor((2048,), seed=i) for i in range(32)]
            assert await b.batched_put(keys, vals) == [True] * 32
            for d in os.listdir(paths[1]):
                if d.startswith(("ns-", "ns2-")):
                    shutil.rmtree(os.path.join(paths[1], d))
            got = await b.batched_get(keys)
            for k, g, v in zip(keys, got, vals, strict=True):
                if b.stripe_index(k) == 0:
                    assert same_bits(g, v)
                else:
                    assert g is None
            assert await b.batched_put(keys, vals) == [True] * 32
            assert all(
                same_bits(g, v) for g, v in zip(await b.batched_get(keys), vals, strict=True)
            )
        finally:
            await b.close()

    asyncio.run(body())
