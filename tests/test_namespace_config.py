"""The hierarchy's namespace is explicit: the configuration's ``namespace`` section, an
argument, or the visible ``default`` one (never ``""``), with the messages users see."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "plugin_fixtures"))

from test_cli_plugins import run

from lmcache_core import TieredHierarchy, load_config
from lmcache_core.cli import main as cli
from lmcache_core.config.namespaces import (
    configured_namespace,
    namespace_label,
    namespace_warnings,
    resolve_namespace,
)
from lmcache_core.errors import ConfigError
from lmcache_core.keys import CacheEngineKey, Namespace


def key(i: int) -> CacheEngineKey:
    return CacheEngineKey("m", 1, 0, i + 1, "float32")


def disk_tiers(tmp_path: Path) -> list[dict[str, object]]:
    return [{"backend": "cpu"}, {"backend": f"file://{tmp_path}/kv"}]


def test_without_a_namespace_the_hierarchy_uses_a_visible_default(tmp_path, caplog):
    cfg = load_config({"tiers": disk_tiers(tmp_path)})
    assert cfg.namespace is None
    with caplog.at_level(logging.WARNING, logger="lmcache_core.hierarchy"):
        h = TieredHierarchy.from_config(cfg)
    ns = h.namespace
    assert ns is not None and ns.to_json() != ""
    assert dict(ns.extra) == {"name": "default"}
    assert (ns.chunk_size, ns.hash_algorithm) == (cfg.chunk_size, cfg.hash_algorithm)
    assert h.stats()["namespace"] == "default"
    assert "namespace: not set, so the tiers use the namespace 'default'" in caplog.text

    async def stored() -> str | None:
        async with h:
            await h.put(key(1), torch.ones(16))
            await h.flush()
            disk = h.tiers[1].backend
            (entry,) = [e async for e in disk.scan(read_headers=True)]
            return entry.namespace

    assert json.loads(asyncio.run(stored()) or "{}")["extra"] == {"name": "default"}


@pytest.mark.parametrize(
    ("section", "label", "extra"),
    [
        ("team-a", "team-a", {"name": "team-a"}),
        ({"name": "team-a"}, "team-a", {"name": "team-a"}),
        ({"model": "llama", "revision": "abc"}, "model=llama@abc", {}),
        (
            {"model": "llama", "layout": "nhd", "name": "x"},
            "model=llama, layout=nhd, name=x",
            {"name": "x"},
        ),
    ],
)
def test_a_configured_namespace(section, label, extra):
    cfg = load_config({"namespace": section})
    ns = configured_namespace(cfg)
    assert dict(ns.extra) == extra
    h = TieredHierarchy.from_config(cfg)
    assert h.namespace == ns
    assert namespace_label(ns) == label
    assert cfg.to_dict()["namespace"]["name"] == extra.get("name", "")


def test_the_default_label_and_an_argument():
    assert namespace_label(configured_namespace(load_config(None))) == "default"
    given = Namespace(model_name="m")
    h = TieredHierarchy.from_config(None, namespace=given)
    assert h.namespace == given  # an argument wins when the configuration names none


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {},
            "namespace: names nothing: give a model (and revision, layout) or a name, or "
            "leave the section out for the 'default' namespace",
        ),
        (
            {"modle": "x"},
            "namespace.modle: unknown key; did you mean 'model'? (known: model, "
            "revision, layout, name)",
        ),
        ({"model": 3}, "namespace.model: expected a string, got int"),
        (["x"], "namespace: expected a mapping, got list"),
        ({"name": "x" * (300 << 10)}, "namespace: namespace JSON is "),
    ],
)
def test_bad_namespace_sections_say_where(section, message):
    with pytest.raises(ConfigError) as ei:
        load_config({"namespace": section})
    assert str(ei.value).startswith(message), str(ei.value)


def test_an_argument_fills_in_and_must_agree_with_the_configuration():
    cfg = load_config({"namespace": {"model": "llama", "name": "team-a"}})
    merged = resolve_namespace(cfg, Namespace(kv_layout="nhd"))
    assert (merged.model_name, merged.kv_layout, dict(merged.extra)) == (
        "llama", "nhd", {"name": "team-a"},
    )  # fmt: skip
    with pytest.raises(ConfigError) as ei:
        TieredHierarchy.from_config(cfg, namespace=Namespace(model_name="qwen"))
    assert str(ei.value) == (
        "namespace.model: the configuration names model 'llama' but the namespace argument "
        "uses 'qwen'; remove namespace.model or make them agree"
    )
    with pytest.raises(ConfigError) as ei:
        resolve_namespace(cfg, Namespace(extra=(("name", "team-b"),)), "the caller")
    assert str(ei.value) == (
        "namespace.name: the configuration names namespace 'team-a' but the caller uses "
        "'team-b'; remove namespace.name or make them agree"
    )


def test_config_check_warns_when_a_shared_tier_has_no_namespace(tmp_path, capsys):
    plain = tmp_path / "plain.yaml"
    plain.write_text(json.dumps({"tiers": disk_tiers(tmp_path)}))
    res = run("config", "check", str(plain), "--table")  # the real console script, once
    assert res.returncode == 0, res.stderr
    assert "  namespace: default\n" in res.stdout
    assert (
        "  warning: namespace: not set, so the tiers use the namespace 'default'; a tier "
        "shared between models (disk (disk)) should name one, e.g. `namespace: {model: "
        "my-model, revision: abc123}` or `namespace: my-deployment` (the vLLM connector "
        "supplies its own)"
    ) in res.stdout

    def cli_out(*args: str) -> str:
        assert cli.main(list(args)) == 0
        return str(capsys.readouterr().out)

    as_json = json.loads(cli_out("config", "check", str(plain), "--json"))
    assert as_json["ok"] is True and as_json["namespace"] == "default"
    assert as_json["warnings"] == namespace_warnings(load_config(plain))
    named = tmp_path / "named.yaml"
    named.write_text(json.dumps({"namespace": "team-a", "tiers": disk_tiers(tmp_path)}))
    text = cli_out("config", "check", str(named), "--table")
    assert "  namespace: team-a\n" in text and "warning" not in text
    assert namespace_warnings(load_config(None)) == []  # a memory-only tier needs no name
    show = json.loads(cli_out("config", "show", str(named), "--json"))
    assert show["namespace"] == {"model": "", "revision": "", "layout": "", "name": "team-a"}
