"""The byte-store base class (:mod:`lmcache_core.blob`) through the contract suite, with
an async in-memory store and a sync directory store (``tests/blob_stores.py``), plus its
own behaviour: layout, verification, prefix lookups, maintenance, start errors."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from blob_stores import DictBlobBackend, DirBlobBackend

from lmcache_core.blob import BlobBackend, is_object_name, namespace_dir, object_name
from lmcache_core.errors import ConfigError
from lmcache_core.keys import CacheEngineKey, Namespace
from lmcache_core.maintenance import MaintainableBackend
from lmcache_core.testing import (
    BackendContract,
    CorruptionContract,
    NamespaceContract,
    PersistentContract,
    ProcessContract,
    SharedContract,
    make_key,
    random_tensor,
    run_async,
    same_bits,
)
from lmcache_core.testing.blob import corrupt_blob

NS = Namespace(model_name="blob-test", chunk_size=64)


class TestDictBlobContract(
    BackendContract, PersistentContract, SharedContract, CorruptionContract, NamespaceContract
):
    """Async byte operations on the event loop."""

    @pytest.fixture
    def objects(self) -> dict[str, tuple[bytes, float]]:
        return {}

    @pytest.fixture
    def backend_factory(self, objects: dict[str, tuple[Any, float]]) -> Callable[..., Any]:
        return lambda **opts: DictBlobBackend(objects, opts, namespace=NS)

    @pytest.fixture
    def namespace_factory(self, objects: dict[str, tuple[Any, float]]) -> Callable[..., Any]:
        return lambda ns: DictBlobBackend(objects, namespace=ns)

    @pytest.fixture
    def corrupt_entry(self) -> Callable[..., Any]:
        return corrupt_blob


class TestDirBlobContract(
    BackendContract,
    PersistentContract,
    SharedContract,
    CorruptionContract,
    NamespaceContract,
    ProcessContract,
):
    """Sync byte operations on the base's threads, a directory as the store."""

    @pytest.fixture
    def root(self, tmp_path: Path) -> str:
        (tmp_path / "store").mkdir()
        return str(tmp_path / "store")

    @pytest.fixture
    def backend_factory(self, root: str) -> Callable[..., Any]:
        return lambda **opts: DirBlobBackend({"path": root, **opts}, namespace=NS)

    @pytest.fixture
    def namespace_factory(self, root: str) -> Callable[..., Any]:
        return lambda ns: DirBlobBackend({"path": root}, namespace=ns)

    @pytest.fixture
    def corrupt_entry(self) -> Callable[..., Any]:
        return corrupt_blob

    @pytest.fixture
    def backend_spec(self, root: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
        import os

        # the child process imports blob_stores from this directory
        tests_dir = os.path.dirname(__file__)
        monkeypatch.setenv(
            "PYTHONPATH",
            os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH", "")) if p),
        )
        return {
            "target": "blob_stores:DirBlobBackend",
            "options": {"path": root},
            "namespace": NS.to_json(),
        }


# ---------------------------------------------------------------------------- behaviour
def _dict_backend(**opts: Any) -> tuple[DictBlobBackend, dict[str, tuple[bytes, float]]]:
    objects: dict[str, tuple[Any, float]] = {}
    return DictBlobBackend(objects, opts, namespace=NS), objects


def test_layout_names_and_marker() -> None:
    async def body() -> None:
        b, objects = _dict_backend()
        await b.start()
        key = make_key("layout")
        await b.put(key, random_tensor((16,)))
        name = b.object_name(key)
        assert name == object_name(NS, key) == f"{namespace_dir(NS)}/{key.to_path()}"
        assert is_object_name(name) and not is_object_name(f"{namespace_dir(NS)}/namespace.json")
        assert set(objects) == {name, f"{namespace_dir(NS)}/namespace.json"}
        assert await b.namespaces() == {namespace_dir(NS): NS.to_json()}
        await b.close()

    run_async(body())


def test_corrupt_object_is_counted_and_deleted() -> None:
    async def body() -> None:
        b, objects = _dict_backend()
        await b.start()
        key = make_key("bad")
        await b.put(key, random_tensor((4096,)))
        await corrupt_blob(b, key, "flip")
        assert await b.get(key) is None
        st = b.stats()
        assert st["corrupt_objects"] == 1 and st["removed_corrupt"] == 1
        assert b.object_name(key) not in objects
        await b.close()

    run_async(body())


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 33, 64])
def test_contains_prefix_within_log_requests(n: int) -> None:
    async def body() -> None:
        b, _ = _dict_backend(lookup_cache_s=0, negative_cache_s=0)
        await b.start()
        keys = [make_key(f"pfx{i}") for i in range(n)]
        for stored in sorted({0, 1, n // 2, n - 1, n}):
            for k in keys:
                await b.remove(k)
            for k in keys[:stored]:
                await b.put(k, random_tensor((4,)))
            before = b.stats()["exists_requests"]
            assert await b.contains_prefix(keys) == stored
            used = b.stats()["exists_requests"] - before
            assert used <= math.ceil(math.log2(n)) + 1 == BlobBackend.max_prefix_requests(n)
        assert b.stats()["prefix_lookup_requests_max"] <= math.ceil(math.log2(n)) + 1
        await b.close()

    run_async(body())


def test_existence_cache_answers_repeated_lookups() -> None:
    async def body() -> None:
        b, _ = _dict_backend(lookup_cache_s=30, negative_cache_s=30)
        await b.start()
        keys = [make_key(f"c{i}") for i in range(16)]
        for k in keys[:10]:
            await b.put(k, random_tensor((4,)))
        assert await b.contains_prefix(keys) == 10
        before = b.stats()["exists_requests"]
        assert await b.contains_prefix(keys) == 10
        assert b.stats()["exists_requests"] == before  # all answered from the cache
        await b.close()

    run_async(body())


def test_maintenance_scan_verify_delete(tmp_path: Path) -> None:
    async def body() -> None:
        b = DirBlobBackend({"path": str(tmp_path)}, namespace=NS)
        await b.start()
        assert isinstance(b, MaintainableBackend)
        keys = [make_key(f"m{i}") for i in range(5)]
        for i, k in enumerate(keys):
            await b.put(k, random_tensor((1000,), seed=i))
        await corrupt_blob(b, keys[1], "truncate")
        await corrupt_blob(b, keys[2], "foreign")
        (tmp_path / "stray.txt").write_text("not an object")
        entries = [e async for e in b.scan(read_headers=True)]
        assert sorted(e.location for e in entries) == sorted(b.object_name(k) for k in keys)
        by_loc = {e.location: e for e in entries}
        assert by_loc[b.object_name(keys[0])].key == keys[0].to_string()
        assert by_loc[b.object_name(keys[0])].namespace == NS.to_json()
        reasons = {e.location: await b.check_entry(e) for e in entries}
        assert reasons[b.object_name(keys[0])] is None
        assert "truncated" in str(reasons[b.object_name(keys[1])])
        assert "another key" in str(reasons[b.object_name(keys[2])])
        assert await b.delete_entry(by_loc[b.object_name(keys[1])])
        assert await b.get(keys[1]) is None
        usage = await b.usage()
        assert usage["entries"] == 4 and usage["max_bytes"] is None
        await b.close()

    run_async(body())


def test_open_failure_is_one_config_error_naming_the_tier(tmp_path: Path) -> None:
    b = DirBlobBackend({"path": str(tmp_path / "absent")}, name="remote")
    with pytest.raises(ConfigError) as info:
        run_async(b.start())
    msg = str(info.value)
    assert msg.startswith("tier 'remote' (file://") and "does not exist" in msg


def test_event_loop_free_with_sync_store(tmp_path: Path) -> None:
    """Sync byte operations never run on the loop's thread."""
    import threading

    seen: list[str] = []

    class Spy(DirBlobBackend):
        def read_object(self, name: str) -> bytes | None:
            seen.append(threading.current_thread().name)
            return super().read_object(name)

    async def body() -> None:
        b = Spy({"path": str(tmp_path)}, namespace=NS)
        await b.start()
        k = make_key("spy")
        v = random_tensor((64,), torch.float32)
        await b.put(k, v)
        assert same_bits(await b.get(k), v)
        out = torch.empty_like(v)
        assert await b.get_into(k, out) and same_bits(out, v)
        await b.close()

    run_async(body())
    assert seen and all(n.startswith("lmcache-") for n in seen), seen


def test_key_strings_never_escape_the_layout() -> None:
    key = CacheEngineKey("../../etc/passwd", 1, 0, 5, "float16")
    assert is_object_name(object_name(NS, key))
    assert object_name(NS, key).startswith(namespace_dir(NS) + "/")
