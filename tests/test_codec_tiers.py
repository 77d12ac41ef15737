"""Tier codecs in the hierarchy: configuration, namespaces, headers, misses, promotion.

Real disk tiers in temporary directories and the first-party codec plugins (installed
by ``make venv``); no engine."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_core import TieredHierarchy
from lmcache_core import format as fmt
from lmcache_core.config import load_config
from lmcache_core.config.namespaces import resolve_namespace
from lmcache_core.errors import ConfigError
from lmcache_core.keys import CacheEngineKey, Namespace
from lmcache_core.plugins import BackendRegistry, PluginSettings, load_plugins
from lmcache_core.plugins.codec_registry import CodecRegistry, codecs_for
from lmcache_core.testing.codecs import kv_like

NS = {"name": "codec-tests"}


def _cfg(path: Path, codec: Any = None, cpu: bool = True) -> dict[str, Any]:
    disk: dict[str, Any] = {"name": "disk", "backend": "disk", "options": {"path": str(path)}}
    if codec is not None:
        disk["codec"] = codec
    tiers = [{"name": "cpu", "backend": "cpu", "options": {"max_bytes": "64MiB"}}] if cpu else []
    return {"namespace": NS, "tiers": [*tiers, disk]}


def _key(i: int) -> CacheEngineKey:
    return CacheEngineKey("codec-model", 1, 0, 1000 + i, "float32")


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _store(cfg: dict[str, Any], items: dict[int, torch.Tensor]) -> None:
    h = TieredHierarchy.from_config(cfg)
    await h.start()
    try:
        for i, x in items.items():
            assert await h.put(_key(i), x)
        await h.flush()
    finally:
        await h.close()


async def _load(
    cfg: dict[str, Any], i: int, like: torch.Tensor
) -> tuple[bool, torch.Tensor, dict[str, Any]]:
    h = TieredHierarchy.from_config(cfg)
    await h.start()
    try:
        out = torch.full_like(like, 7.0)
        hit = await h.get_into(_key(i), out)
        return hit, out, h.stats()
    finally:
        await h.close()


def _disk_stats(stats: dict[str, Any]) -> dict[str, Any]:
    tiers = stats["tiers"]
    return next(
        t for t in (tiers.values() if isinstance(tiers, dict) else tiers) if t["name"] == "disk"
    )


# ---------------------------------------------------------------------------- round trips
def test_lossless_disk_tier_is_bit_exact_and_smaller(tmp_path: Path) -> None:
    x = kv_like((4, 2, 2, 32, 128), torch.bfloat16)
    cfg = _cfg(tmp_path, "lossless", cpu=False)
    _run(_store(cfg, {1: x}))
    hit, out, stats = _run(_load(cfg, 1, x))
    assert hit and torch.equal(out.view(torch.int16), x.view(torch.int16))
    assert _disk_stats(stats)["codec"]["decoded"] == 1
    files = [p for p in tmp_path.rglob("*") if p.is_file() and len(p.name) == 32]
    assert len(files) == 1
    assert files[0].stat().st_size < x.nbytes  # compressed, header included


def test_header_records_codec_and_options(tmp_path: Path) -> None:
    x = kv_like((2, 2, 2, 32, 64))
    cfg = _cfg(tmp_path, {"name": "int8", "options": {"group_size": 64}}, cpu=False)
    _run(_store(cfg, {1: x}))
    (obj,) = [p for p in tmp_path.rglob("*") if p.is_file() and len(p.name) == 32]
    header = fmt.decode_header(obj.read_bytes())
    assert header.codec == 'int8 {"group_size":64}'
    assert header.dtype == torch.uint8
    assert Namespace.from_json(header.namespace).codec == 'lossy:int8 {"group_size":64}'


# ---------------------------------------------------------------------------- namespaces
def test_exact_and_lossy_hierarchies_on_one_disk_never_share(tmp_path: Path) -> None:
    """An exact instance and a lossy one on the same directory: each sees only its own."""
    x, y = kv_like((2, 2, 2, 32, 64), seed=1), kv_like((2, 2, 2, 32, 64), seed=2)
    exact, lossy = _cfg(tmp_path), _cfg(tmp_path, "int8")
    _run(_store(exact, {1: x}))
    _run(_store(lossy, {2: y}))
    assert not _run(_load(lossy, 1, x))[0]  # the exact chunk is not offered to int8
    assert not _run(_load(exact, 2, y))[0]  # and int8's chunk never to the exact one
    hit, out, _ = _run(_load(exact, 1, x))
    assert hit and torch.equal(out, x)
    hit, out, _ = _run(_load(lossy, 2, y))
    assert hit and 0 < float((out - y).abs().max()) < 0.1
    namespaces = {p.name for p in tmp_path.iterdir() if p.name.startswith(("ns-", "ns2-"))}
    assert len(namespaces) == 2


def test_namespace_codec_label() -> None:
    lossy = load_config(
        _cfg(Path("/nonexistent-kv"), {"name": "cachegen", "options": {"bits": [6]}})
    )
    h = TieredHierarchy(lossy)
    assert h.namespace.codec.startswith("lossy:cachegen ")
    assert '"bits":[6]' in h.namespace.codec
    lossless = TieredHierarchy(load_config(_cfg(Path("/nonexistent-kv"), "lossless")))
    assert lossless.namespace.codec.startswith("lossless:lossless ")
    plain = TieredHierarchy(load_config(_cfg(Path("/nonexistent-kv"))))
    assert plain.namespace.codec == ""
    assert len({h.namespace.digest(), lossless.namespace.digest(), plain.namespace.digest()}) == 3


def test_a_given_namespace_gets_the_codec() -> None:
    """The vLLM connector passes its own namespace: the tiers' codec is added to it."""
    cfg = load_config({"tiers": [{"name": "cpu", "backend": "cpu", "codec": "int8"}]})
    ns = resolve_namespace(cfg, Namespace(model_name="m"))
    assert ns.model_name == "m" and ns.codec.startswith("lossy:int8")
    with pytest.raises(ConfigError, match="codec"):
        resolve_namespace(cfg, Namespace(model_name="m", codec="lossy:int4 {}"))


# ---------------------------------------------------------------------------- misses
def test_undecodable_object_is_a_counted_miss(tmp_path: Path) -> None:
    """A sound object (header and checksum right) whose envelope does not decode."""
    x = kv_like((2, 2, 2, 32, 64))
    cfg = _cfg(tmp_path, "int8", cpu=False)
    h = TieredHierarchy.from_config(cfg)
    ns = h.namespace

    async def plant() -> None:
        from lmcache_core.codecs import wrap_envelope
        from lmcache_core.plugins.codec_registry import get_codec_registry

        other = wrap_envelope(get_codec_registry().create("int4"), x)  # another codec's bytes
        b = TieredHierarchy.from_config(cfg)
        await b.start()
        try:
            assert await b.tiers[0].backend.put(_key(1), other)
            garbage = torch.arange(200, dtype=torch.uint8)
            assert await b.tiers[0].backend.put(_key(2), garbage)
        finally:
            await b.close()

    _run(plant())
    for i in (1, 2):
        hit, _, stats = _run(_load(cfg, i, x))
        assert not hit
        assert _disk_stats(stats)["codec"]["decode_errors"] == 1
        assert _disk_stats(stats)["misses"] == 1
    assert h.namespace == ns


def test_non_finite_chunk_is_not_stored_by_a_lossy_tier(tmp_path: Path) -> None:
    x = kv_like((2, 2, 2, 32, 64))
    x[0, 0, 0, 0, 0] = float("inf")
    cfg = _cfg(tmp_path, "int8", cpu=False)

    async def go() -> dict[str, Any]:
        h = TieredHierarchy.from_config(cfg)
        await h.start()
        try:
            assert not await h.put(_key(1), x)
            return h.stats()
        finally:
            await h.close()

    stats = _run(go())
    assert _disk_stats(stats)["codec"]["encode_errors"] == 1


# ---------------------------------------------------------------------------- promotion
def test_promotion_decodes_once(tmp_path: Path) -> None:
    x = kv_like((2, 2, 2, 32, 64))
    cfg = _cfg(tmp_path, "cachegen")
    _run(_store(cfg, {1: x}))

    async def go() -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        h = TieredHierarchy.from_config(cfg)
        await h.start()
        try:
            first, second = torch.empty_like(x), torch.empty_like(x)
            assert await h.get_into(_key(1), first)  # from disk: decoded, promoted to cpu
            await h.flush()
            assert await h.get_into(_key(1), second)  # from cpu: no decode
            return first, second, h.stats()
        finally:
            await h.close()

    first, second, stats = _run(go())
    assert _disk_stats(stats)["codec"]["decoded"] == 1
    assert torch.equal(first, second)  # the cpu tier holds the decoded chunk


# ---------------------------------------------------------------------------- config
def test_unknown_codec_names_the_plugin_to_install() -> None:
    registry = BackendRegistry()
    load_plugins(registry, settings=PluginSettings(disabled=frozenset({"lmcache-codec-cachegen"})))
    with pytest.raises(ConfigError) as err:
        load_config({"tiers": [{"backend": "cpu", "codec": "cachegen"}]}, registry=registry)
    msg = str(err.value)
    assert msg.startswith("tiers[0].codec.name: unknown codec 'cachegen'")
    assert "lmcache-codec-cachegen is installed but its plugin did not load" in msg
    assert "unknown codec 'int8'" in CodecRegistry().unknown_message("int8")
    assert "pip install ./plugins/lmcache-codec-quant" in CodecRegistry().unknown_message("int8")
    with pytest.raises(ConfigError, match=r"unknown codec 'in8'.*did you mean 'int8'"):
        load_config({"tiers": [{"backend": "cpu", "codec": "in8"}]})
    assert "cachegen" not in codecs_for(registry)


@pytest.mark.parametrize(
    ("codec", "where", "text"),
    [
        ({"name": "int8", "options": {"group_size": 1}}, "tiers[1].codec.options", "group_size"),
        ({"name": "int8", "options": {"bits": 3}}, "tiers[1].codec.options", "no option"),
        ({"options": {}}, "tiers[1].codec.name", "needs a name"),
        ({"name": "int8", "level": 3}, "tiers[1].codec.level", "unknown key"),
    ],
)
def test_bad_codec_config_says_where(codec: Any, where: str, text: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_cfg(Path("/nonexistent-kv"), codec))
    assert err.value.path == where and text in err.value.reason


def test_write_back_below_a_coded_tier_is_refused() -> None:
    cfg = {
        "tiers": [
            {"name": "cpu", "backend": "cpu", "codec": "int8"},
            {
                "name": "disk",
                "backend": "disk",
                "options": {"path": "/nonexistent-kv"},
                "write": {"policy": "back"},
            },
        ]
    }
    with pytest.raises(ConfigError, match="write-back"):
        load_config(cfg)


def test_codec_in_resolved_config() -> None:
    cfg = load_config(_cfg(Path("/nonexistent-kv"), "int8"))
    assert cfg.tiers[1].codec == {"name": "int8", "options": {"group_size": 32}}
    assert cfg.to_dict()["tiers"][1]["codec"] == {"name": "int8", "options": {"group_size": 32}}
    assert cfg.tiers[0].codec is None
    assert os.fspath(cfg.tiers[1].options.path) == "/nonexistent-kv"


def test_known_codecs_name_distributions_in_the_repository() -> None:
    from lmcache_core.plugins.codec_registry import KNOWN_CODECS, get_codec_registry

    root = Path(__file__).resolve().parents[1]
    for name, dist in KNOWN_CODECS.items():
        assert (root / "plugins" / dist / "pyproject.toml").is_file(), dist
        spec = get_codec_registry().get(name)
        assert spec.provider == dist  # the plugin that registers it is the one named


def test_a_coded_top_tier_serves_no_thread_loads_or_borrows(tmp_path: Path) -> None:
    """Coded chunks are decoded by the tier on a thread: neither the copying fast path
    nor the borrowing one may hand out the stored (encoded) bytes of a coded top tier."""
    cfg = {
        "namespace": NS,
        "tiers": [
            {"name": "cpu", "backend": "cpu", "options": {"max_bytes": "64MiB"}, "codec": "int8"}
        ],
    }
    x = kv_like((2, 2, 2, 32, 64))

    async def go() -> tuple[Any, Any, bool, torch.Tensor]:
        h = TieredHierarchy.from_config(cfg)
        await h.start()
        try:
            assert await h.put(_key(1), x)
            await h.flush()
            lent = await asyncio.to_thread(h.try_borrow_threadsafe, [_key(1)])
            out = torch.zeros_like(x)
            copied = await asyncio.to_thread(h.try_batched_get_into_threadsafe, [_key(1)], [out])
            hit = await h.get_into(_key(1), out)
            return lent, copied, hit, out
        finally:
            await h.close()

    lent, copied, hit, out = _run(go())
    assert lent is None and copied is None
    assert hit and (out - x).abs().max().item() < 0.1  # the async path decodes


def test_envelope_codec_of_a_device_tensor_does_not_raise() -> None:
    """The disk and gds tiers ask every uint8 value for its codec before a put; a device
    tensor (a CUDA value put into gds) must get an answer, not a CPU-only error. The meta
    device stands in for CUDA here (no data: raw); CPU envelopes are still recognised."""
    from lmcache_core.codecs import envelope_codec, wrap_envelope
    from lmcache_core.plugins.codec_registry import get_codec_registry

    assert envelope_codec(torch.empty(1 << 20, dtype=torch.uint8, device="meta")) == "raw"
    assert envelope_codec(torch.zeros(64, dtype=torch.uint8)) == "raw"
    env = wrap_envelope(get_codec_registry().create("int4"), kv_like((2, 2, 2, 32, 64)))
    assert envelope_codec(env) != "raw"
    assert envelope_codec(env) == envelope_codec(env.clone())
