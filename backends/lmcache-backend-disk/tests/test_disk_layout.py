"""The object layouts: layout 2 (``ns2-…/ab/<name>``) for new namespaces, layout 1
(``ns-…/ab/cd/<name>``) kept for namespaces older versions wrote, read from a tier an
older version wrote (``data/layout1_tier.tar.gz``, see ``data/make_layout1_tier.py``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from disk_testutil import object_files, run
from lmcache_backend_disk import DiskBackend, layout
from lmcache_backend_disk.layout import INDEX_FILE, META_DIR

from lmcache_core import CacheEngineKey, Namespace
from lmcache_core.cli.main import main
from lmcache_core.testing import random_tensor, same_bits

DATA = Path(__file__).parent / "data"
# what data/make_layout1_tier.py wrote (kept in step with it by test_the_archive_is_what_...)
OLD_NS = {
    "a": Namespace(model_name="layout1-a", kv_dtype="float16", block_size=16),
    "b": Namespace(model_name="layout1-b", kv_dtype="float16", block_size=16),
}
OLD_KEYS = {"a": range(4), "b": range(2)}
NEW_NS = Namespace(model_name="layout2-c", kv_dtype="float16", block_size=16)


def old_value(ns: str, i: int) -> torch.Tensor:
    base = 1000 * (ord(ns) - ord("a")) + 10 * i
    return (torch.arange(1024, dtype=torch.float32) + base).to(torch.float16)


def old_key(ns: str, i: int) -> CacheEngineKey:
    return CacheEngineKey(f"layout1-{ns}", 1, 0, i + 1, "float16")


def new_key(i: int) -> CacheEngineKey:
    return CacheEngineKey("layout2-c", 1, 0, i + 1, "float16")


def _b(root: Path, namespace: Namespace, **opts: Any) -> DiskBackend:
    return DiskBackend({"path": str(root), "max_bytes": "64MiB", **opts}, namespace=namespace)


def _old_tier(tmp_path: Path) -> Path:
    with tarfile.open(DATA / "layout1_tier.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    root = tmp_path / "tier"
    for d, _dirs, _files in os.walk(root):  # as the old version left them (git keeps no modes)
        os.chmod(d, 0o700)
    return root


def _put_new(root: Path, n: int) -> None:
    """Store ``new_key(i)`` -> ``old_value("b", i)`` for ``i < n`` in the namespace the
    old tier does not have (layout 2)."""

    async def body() -> None:
        c = _b(root, NEW_NS)
        await c.start()
        try:
            keys, vals = [new_key(i) for i in range(n)], [old_value("b", i) for i in range(n)]
            assert all(await c.batched_put(keys, vals))
            assert c._rel(keys[0]).startswith("ns2-")
        finally:
            await c.close()

    run(body())


def _cli(*args: str) -> tuple[int, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(list(args))
    return rc, json.loads(out.getvalue())


# ---------------------------------------------------------------- paths
def test_object_paths_of_both_layouts() -> None:
    key = new_key(0)
    name = key.to_path().rsplit("/", 1)[1]
    ns_json = layout.namespace_json(NEW_NS)
    flat, nested = layout.namespace_dir(ns_json), layout.namespace_dir(ns_json, flat=False)
    assert flat.startswith("ns2-") and nested.startswith("ns-") and flat[4:] == nested[3:]
    assert layout.object_relpath(flat, key) == f"{flat}/{name[:2]}/{name}"
    assert layout.object_relpath(nested, key) == f"{nested}/{name[:2]}/{name[2:4]}/{name}"
    for rel in (layout.object_relpath(flat, key), layout.object_relpath(nested, key)):
        assert layout.is_object_relpath(rel)
        assert layout.is_expected_location(rel, key.to_string(), ns_json)
        assert not layout.is_expected_location(rel, new_key(1).to_string(), ns_json)
        assert not layout.is_expected_location(rel, key.to_string(), '{"other": 1}')
    other = "ff" if name[:2] != "ff" else "00"
    bad = [
        f"{flat}/{name[:2]}/{name[2:4]}/{name}",  # layout 1's depth under a layout-2 directory
        f"{nested}/{name[:2]}/{name}",  # and the reverse
        f"{flat}/{other}/{name}",  # a shard that is not the name's
        f"{nested}/{name[:2]}/{other}/{name}",
        f"{flat}/{name[:2]}/{name[:31]}",
        f"{flat}/{name[:2]}/{name}/x",
        f"ns3-{flat[4:]}/{name[:2]}/{name}",
        f"{flat}/../{name[:2]}/{name}",
        f"/{flat}/{name[:2]}/{name}",
        f"{flat}/{name[:2].upper()}/{name.upper()}",
    ]
    for rel in bad:
        assert not layout.is_object_relpath(rel), rel


def test_a_new_tier_uses_layout_2_and_makes_one_directory_per_shard(tmp_path: Path) -> None:
    root = tmp_path / "tier"
    keys = [new_key(i) for i in range(300)]
    vals = [random_tensor((64,), torch.float16, seed=i) for i in range(300)]

    async def body() -> None:
        b = _b(root, NEW_NS)
        await b.start()
        try:
            assert all(await b.batched_put(keys, vals))
            got = await b.batched_get(keys)
            assert all(same_bits(g, v) for g, v in zip(got, vals, strict=True))
        finally:
            await b.close()

    run(body())
    (ns_dir,) = [p for p in os.listdir(root) if p != META_DIR]
    assert ns_dir.startswith("ns2-")
    shards = {p.name for p in (root / ns_dir).iterdir() if p.is_dir()}
    names = {k.to_path().rsplit("/", 1)[1] for k in keys}
    assert shards == {n[:2] for n in names}  # one directory level, 256 at most
    assert {Path(rel).name for rel in object_files(str(root))} == names
    assert all(len(Path(rel).parts) == 3 for rel in object_files(str(root)))


# ---------------------------------------------------------------- a tier an older version wrote
def test_the_archive_is_what_its_script_writes() -> None:
    """The test's copy of the old tier's keys and values matches the script that made it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_layout1", DATA / "make_layout1_tier.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert {k: Namespace(**v) for k, v in mod.NAMESPACES.items()} == OLD_NS
    assert mod.KEYS == OLD_KEYS
    for ns, keys in OLD_KEYS.items():
        assert all(torch.equal(mod.value(ns, i), old_value(ns, i)) for i in keys)


def test_an_older_tier_is_read_and_its_namespaces_keep_layout_1(tmp_path: Path) -> None:
    root = _old_tier(tmp_path)
    before = object_files(str(root))
    assert len(before) == 6 and all(rel.startswith("ns-") for rel in before)

    async def body() -> None:
        a = _b(root, OLD_NS["a"])
        c = _b(root, NEW_NS)
        await a.start()
        await c.start()
        try:
            keys = [old_key("a", i) for i in OLD_KEYS["a"]]
            assert await a.batched_contains(keys) == [True] * 4
            got = await a.batched_get(keys)
            for i, g in zip(OLD_KEYS["a"], got, strict=True):
                assert g is not None and torch.equal(g, old_value("a", i))
            # a new chunk of an old namespace goes where older versions would look for it
            k4 = old_key("a", 4)
            assert await a.put(k4, old_value("a", 4))
            assert a._rel(k4) == layout.object_relpath(
                layout.namespace_dir(layout.namespace_json(OLD_NS["a"]), flat=False), k4
            )
            # a namespace the old tier does not have gets layout 2, beside it
            assert await c.put(new_key(0), old_value("a", 9))
            assert c._rel(new_key(0)).startswith("ns2-")
            got_c = await c.get(new_key(0))
            assert got_c is not None and torch.equal(got_c, old_value("a", 9))
        finally:
            await a.close()
            await c.close()

    run(body())
    after = object_files(str(root))
    assert set(before) < set(after) and len(after) == 8
    assert sum(rel.startswith("ns2-") for rel in after) == 1

    # maintenance sees both layouts, finds nothing wrong and drops no index row
    rc, doc = _cli("verify", "--path", str(root), "--json")
    assert rc == 0 and doc["verify"][0]["checked"] == 8 and doc["verify"][0]["bad"] == 0
    rc, doc = _cli("gc", "--path", str(root), "--json")
    assert rc == 0
    assert object_files(str(root)) == after

    async def reopen() -> None:
        b = _b(root, OLD_NS["b"])
        await b.start()
        try:
            assert (await b.reconcile())["invalid_rows"] == 0
            got = await b.batched_get([old_key("b", i) for i in OLD_KEYS["b"]])
            for i, g in zip(OLD_KEYS["b"], got, strict=True):
                assert g is not None and torch.equal(g, old_value("b", i))
            assert (await b.usage())["entries"] == 8
        finally:
            await b.close()

    run(reopen())


def test_a_lost_index_is_rebuilt_from_both_layouts(tmp_path: Path) -> None:
    root = _old_tier(tmp_path)
    _put_new(root, 3)
    for name in os.listdir(root / META_DIR):
        if name.startswith(INDEX_FILE):
            os.unlink(root / META_DIR / name)

    async def body() -> None:
        a = _b(root, OLD_NS["a"])
        c = _b(root, NEW_NS)
        await a.start()
        await c.start()
        try:
            assert (await a.usage())["entries"] == 9
            got = await a.batched_get([old_key("a", i) for i in OLD_KEYS["a"]])
            assert all(g is not None for g in got)
            got_c = await c.batched_get([new_key(i) for i in range(3)])
            for i, g in enumerate(got_c):
                assert g is not None and torch.equal(g, old_value("b", i))
        finally:
            await a.close()
            await c.close()

    run(body())


def test_gc_by_namespace_directory_in_either_layout(tmp_path: Path) -> None:
    root = _old_tier(tmp_path)
    _put_new(root, 1)
    flat = layout.namespace_dir(layout.namespace_json(NEW_NS))
    nested = layout.namespace_dir(layout.namespace_json(OLD_NS["b"]), flat=False)
    for ns_dir, left in ((flat, 6), (nested, 4)):
        rc, doc = _cli("gc", "--path", str(root), "--namespace", ns_dir, "--json")
        assert rc == 0, doc
        files = object_files(str(root))
        assert len(files) == left and not any(rel.startswith(ns_dir + "/") for rel in files)


@pytest.mark.parametrize("src_flat", [True, False], ids=["from-layout2", "from-layout1"])
def test_an_object_moved_to_the_other_layouts_path_is_not_served(
    tmp_path: Path, src_flat: bool
) -> None:
    """An object copied to the other layout's path of its own key: the backend reading
    that layout serves it (same key, same namespace: the right bytes), ``verify`` accepts
    it; copied to another key's path of either layout: a miss, and ``verify`` names it."""
    root = tmp_path / "tier"
    ns_json = layout.namespace_json(NEW_NS)
    src_dir = layout.namespace_dir(ns_json, flat=src_flat)
    dst_dir = layout.namespace_dir(ns_json, flat=not src_flat)
    if not src_flat:
        (root / src_dir).mkdir(parents=True, mode=0o700)
    k0, k1 = new_key(0), new_key(1)
    v0 = random_tensor((256,), torch.float16, seed=5)

    async def write() -> None:
        b = _b(root, NEW_NS)
        await b.start()
        try:
            assert b._ns_dir == src_dir
            assert await b.put(k0, v0)
        finally:
            await b.close()

    run(write())
    src = root / layout.object_relpath(src_dir, k0)
    wrong = root / layout.object_relpath(src_dir, k1)
    wrong.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    shutil.copyfile(src, wrong)
    rc, doc = _cli("verify", "--path", str(root), "--json")
    bad = doc["verify"][0]["bad_objects"]
    assert rc == 1 and [b["location"] for b in bad] == [str(wrong.relative_to(root))]
    assert "another key" in bad[0]["reason"]

    async def read() -> None:
        b = _b(root, NEW_NS)
        await b.start()
        try:
            assert (await b.reconcile())["adopted"] == 1  # the index now lists the copy
            assert await b.get(k1) is None  # the other key's bytes are never served
            assert b.stats()["bad_objects"] == 1
            got = await b.get(k0)
            assert got is not None and same_bits(got, v0)
        finally:
            await b.close()

    run(read())
    if src_flat:  # a layout-1 directory appears: the next backend reads layout 1
        (root / dst_dir).mkdir(mode=0o700)
        moved = root / layout.object_relpath(dst_dir, k0)
        moved.parent.mkdir(parents=True, mode=0o700)
        shutil.copyfile(src, moved)

        async def read_nested() -> None:
            b = _b(root, NEW_NS)
            await b.start()
            try:
                assert b._ns_dir == dst_dir
                assert (await b.reconcile())["adopted"] == 1  # the copied object
                got = await b.get(k0)
                assert got is not None and same_bits(got, v0)
            finally:
                await b.close()

        run(read_nested())
