"""open_backend: one backend from a URL or a name plus options, and its errors."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from lmcache_core import open_backend
from lmcache_core.errors import BackendClosedError, ConfigError
from lmcache_core.keys import CacheEngineKey, Namespace
from lmcache_core.open import make_backend


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, i + 1, "float32")


def test_a_disk_url_with_options_in_the_query(tmp_path):
    async def main() -> None:
        url = f"disk://{tmp_path}/kv?max_bytes=64MiB&fsync=false"
        async with open_backend(url) as b:
            assert b.options.path == f"{tmp_path}/kv"
            assert (b.options.max_bytes, b.options.fsync) == (64 << 20, False)
            value = torch.arange(1024, dtype=torch.float32)
            assert await b.put(key(1), value)
            got = await b.get(key(1))
            assert got is not None and torch.equal(got, value)
        with pytest.raises(BackendClosedError):
            await b.get(key(1))  # closed by the async with

    asyncio.run(main())


def test_a_name_and_keyword_options_awaited(tmp_path):
    async def main() -> None:
        b = await open_backend("disk", path=str(tmp_path / "kv"), max_bytes="64MiB")
        try:
            assert b.started and b.options.max_bytes == 64 << 20
        finally:
            await b.close()
        cpu = await open_backend("cpu", max_bytes="1MiB")
        assert cpu.options.max_bytes == 1 << 20
        await cpu.close()
        async with open_backend("memory://?max_bytes=2MiB") as mem:  # a registered scheme
            assert type(mem).__name__ == "CPUBackend" and mem.options.max_bytes == 2 << 20

    asyncio.run(main())


def test_the_namespace_is_default_unless_named(tmp_path):
    async def stored_namespace(sub: str, **kw: object) -> dict[str, object]:
        async with open_backend(f"disk://{tmp_path}/{sub}", **kw) as b:  # type: ignore[arg-type]
            await b.put(key(2), torch.ones(8))
            (entry,) = [e async for e in b.scan(read_headers=True)]
        assert entry.namespace is not None
        ns: dict[str, object] = json.loads(entry.namespace)
        return ns

    assert asyncio.run(stored_namespace("a"))["extra"] == {"name": "default"}
    assert asyncio.run(stored_namespace("b", namespace="team-a"))["extra"] == {"name": "team-a"}
    given = Namespace(model_name="m", model_revision="r")
    ns = asyncio.run(stored_namespace("c", namespace=given))
    assert (ns["model_name"], ns["extra"]) == ("m", {})


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        (
            "dsik:///tmp/x",
            {},
            "backend: no backend handles URL scheme 'dsik'; registered schemes: ",
        ),
        ("dsk", {}, "backend: unknown backend 'dsk'; registered: "),
        (
            "disk:///tmp/x?max_byte=1GiB",
            {},
            "options.max_byte: unknown option; did you mean 'max_bytes'? (known: ",
        ),
        (
            "disk",
            {"path": "/tmp/x", "fsnyc": True},
            "options.fsnyc: unknown option; did you mean 'fsync'?",
        ),
        (
            "disk:///tmp/x?max_bytes=1GiB",
            {"max_bytes": "2GiB"},
            "options.max_bytes: given both in the URL's query string and as an argument",
        ),
        (
            "disk:///tmp/x?max_bytes=1GiB&max_bytes=2GiB",
            {},
            "options.max_bytes: given twice in the query string",
        ),
        (
            "disk://host/tmp/x",
            {},
            "backend: a disk:// URL names a local path and no host: write "
            "disk:///absolute/path (three slashes)",
        ),
        ("disk:///tmp/x?max_bytes=lots", {}, "options.max_bytes: "),
        ("cpu?max_bytes=1GiB", {}, "backend: a query string needs a URL (scheme://...)"),
        ("", {}, "backend: expected a backend name or URL, got ''"),
    ],
)
def test_mistakes_say_where(spec, options, message):
    with pytest.raises(ConfigError) as ei:
        make_backend(spec, **options)
    assert str(ei.value).startswith(message), str(ei.value)


def test_unknown_scheme_and_name_suggest_the_closest():
    with pytest.raises(ConfigError, match=r"did you mean 'disk'\?"):
        make_backend("dsik:///tmp/x")
    with pytest.raises(ConfigError, match=r"did you mean 'disk'\?"):
        make_backend("dsk")


def test_a_start_failure_closes_and_raises(tmp_path):
    missing = tmp_path / "file-not-dir"
    missing.write_text("x")

    async def main() -> None:
        opening = open_backend(f"disk://{missing}/kv")
        with pytest.raises(Exception) as ei:
            async with opening:
                pass
        assert not isinstance(ei.value, ConfigError) or ei.value
        assert opening.backend.closed

    asyncio.run(main())
