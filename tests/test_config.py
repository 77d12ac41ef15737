"""load_config: sources, validation errors with their paths, URL backends, $env, redaction."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_hierarchy_fakes import CountingBackend, FakeUrlBackend, make_registry

from lmcache_core import CPUBackend, TieredHierarchy, load_config
from lmcache_core.config import REDACTED, CacheConfig, schema_markdown
from lmcache_core.errors import ConfigError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

EXAMPLE: dict[str, Any] = {
    "chunk_size": 128,
    "hash_algorithm": "sha256",
    "tiers": [
        {"name": "hot", "backend": "cpu", "options": {"max_bytes": "4GiB"}},
        {
            "name": "warm",
            "backend": "cpu",
            "options": {"max_bytes": "200GiB"},
            "write": {"policy": "back", "admit_after": 2},
            "load_deadline_ms": 200,
            "lookup_deadline_ms": 20,
            "max_queue": 8,
            "max_queue_latency_ms": 500,
            "promote": False,
        },
    ],
}


def load(doc: Any, **kw: Any) -> CacheConfig:
    return load_config(doc, registry=make_registry(), **kw)


def test_default_config_is_one_cpu_tier() -> None:
    cfg = load(None)
    assert [(t.name, t.backend) for t in cfg.tiers] == [("cpu", "cpu")]
    assert cfg.chunk_size == 256 and cfg.hash_algorithm == "xxh3_128"
    assert cfg.hash_salt is None and cfg.stats_dir is None
    assert cfg.tiers[0].backend_cls is CPUBackend
    h = TieredHierarchy.from_config(None)
    assert [t.name for t in h.tiers] == ["cpu"]


def test_dict_yaml_json_and_inline_text_give_the_same_config(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(EXAMPLE))
    (tmp_path / "c.yml").write_text(yaml.safe_dump(EXAMPLE))
    (tmp_path / "c.json").write_text(json.dumps(EXAMPLE))
    configs = [
        load(EXAMPLE),
        load(tmp_path / "c.yaml"),
        load(str(tmp_path / "c.yml")),
        load(tmp_path / "c.json"),
        load(json.dumps(EXAMPLE)),
    ]
    dicts = [c.to_dict() for c in configs]
    assert all(d == dicts[0] for d in dicts)
    cfg = configs[1]
    assert cfg.source == str(tmp_path / "c.yaml")
    assert cfg.chunk_size == 128 and cfg.hash_algorithm == "sha256"
    warm = cfg.tier("warm")
    assert warm.options.max_bytes == 200 * 2**30
    assert (warm.write_policy, warm.admit_after, warm.promote) == ("back", 2, False)
    assert (warm.load_deadline_ms, warm.lookup_deadline_ms) == (200.0, 20.0)
    assert (warm.max_queue, warm.max_queue_latency_ms) == (8, 500.0)
    assert load(cfg) is cfg  # a CacheConfig passes through


def test_to_dict_round_trips_through_load_config() -> None:
    cfg = load(EXAMPLE)
    again = load(cfg.to_dict(redact=False))
    assert again.to_dict() == cfg.to_dict()


def bad(*path_and_value: Any) -> dict[str, Any]:
    """EXAMPLE with one value replaced (path given as keys/indexes)."""
    doc = json.loads(json.dumps(EXAMPLE))
    *where, value = path_and_value
    node = doc
    for k in where[:-1]:
        node = node[k]
    node[where[-1]] = value
    return doc


ERRORS = [
    (bad("chunk_size", 0), "chunk_size", "must be >= 1"),
    (bad("chunk_size", "many"), "chunk_size", "invalid int"),
    (bad("hash_algorithm", "md5"), "hash_algorithm", "must be one of"),
    (bad("hash_salt", ""), "hash_salt", "must not be empty"),
    (bad("stats_interval_s", -1), "stats_interval_s", ">="),
    (bad("tiers", []), "tiers", "at least one tier"),
    (bad("tiers", "cpu"), "tiers", "expected a list"),
    (bad("tiers", 0, "cpu"), "tiers[0]", "expected a mapping"),
    ({"chunk_sise": 1}, "chunk_sise", "did you mean 'chunk_size'"),
    (bad("tiers", 1, "optons", {}), "tiers[1].optons", "did you mean 'options'"),
    (bad("tiers", 1, "backend", "nope"), "tiers[1].backend", "unknown backend 'nope'"),
    (
        bad("tiers", 1, "backend", "disk"),
        "tiers[1].backend",
        "pip install ./backends/lmcache-backend-disk",
    ),
    (bad("tiers", 1, "backend", None), "tiers[1].backend", "required"),
    (bad("tiers", 1, "backend", "s3://bucket/kv"), "tiers[1].backend", "URL scheme 's3'"),
    (bad("tiers", 1, "backend", "cpu://somewhere"), "tiers[1].backend", "takes no url"),
    (bad("tiers", 1, "backend_class", "x.y:Z"), "tiers[1].backend_class", "not both"),
    (bad("tiers", 1, "name", "hot"), "tiers[1].name", "already used by tiers[0]"),
    (bad("tiers", 1, "name", "has space"), "tiers[1].name", "letters, digits"),
    (bad("tiers", 1, "options", {"max_bytes": "12XB"}), "tiers[1].options.max_bytes", "unit"),
    (bad("tiers", 1, "options", {"max_bytes": 0}), "tiers[1].options.max_bytes", ">= 1"),
    (bad("tiers", 1, "options", {"colour": 1}), "tiers[1].options.colour", "unknown option"),
    (
        bad("tiers", 1, "options", {"max_byte": 1}),
        "tiers[1].options.max_byte",
        "did you mean 'max_bytes'",
    ),
    (bad("tiers", 1, "options", {"pin_memory": "maybe"}), "tiers[1].options.pin_memory", "one of"),
    (bad("tiers", 1, "options", []), "tiers[1].options", "expected a mapping"),
    (bad("tiers", 1, "write", {"policy": "sideways"}), "tiers[1].write.policy", "one of"),
    (bad("tiers", 1, "write", {"admit_after": 0}), "tiers[1].write.admit_after", ">= 1"),
    (bad("tiers", 1, "write", {"polcy": "back"}), "tiers[1].write.polcy", "did you mean"),
    (bad("tiers", 0, "write", {"policy": "back"}), "tiers[0].write.policy", "first tier"),
    (bad("tiers", 1, "promote", "perhaps"), "tiers[1].promote", "true or false"),
    (bad("tiers", 1, "load_deadline_ms", -5), "tiers[1].load_deadline_ms", ">= 0"),
    (bad("tiers", 1, "lookup_deadline_ms", "soon"), "tiers[1].lookup_deadline_ms", "invalid"),
    (bad("tiers", 1, "max_queue", 0), "tiers[1].max_queue", ">= 1"),
    (bad("tiers", 1, "max_queue_latency_ms", [1]), "tiers[1].max_queue_latency_ms", "number"),
    (bad("tiers", 1, "write_concurrency", 0), "tiers[1].write_concurrency", ">= 1"),
    (bad("tiers", 1, "hash_salt", {"$env": 3}), "tiers[1].hash_salt", "$env must name"),
    (
        bad("tiers", 1, "options", {"max_bytes": {"$env": "X", "typo": 1}}),
        "tiers[1].options.max_bytes",
        "only '$env' and 'default'",
    ),
]


@pytest.mark.parametrize(
    ("doc", "path", "message"), ERRORS, ids=[e[1] + ":" + e[2] for e in ERRORS]
)
def test_every_error_carries_its_path(doc: Any, path: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(doc, environ={})
    assert info.value.path == path
    assert message in info.value.reason
    assert str(info.value).startswith(f"{path}: ")


def test_write_back_needs_a_tier_that_reports_evictions() -> None:
    doc = {"tiers": [{"name": "top", "backend": "fake://x"},
                     {"name": "low", "backend": "cpu", "write": {"policy": "back"}}]}  # fmt: skip
    # FakeUrlBackend is a CPUBackend: it does report evictions, so this is valid ...
    assert load(doc).tier("low").write_policy == "back"
    # ... a backend class without set_eviction_listener is refused
    doc["tiers"][0] = {"name": "top", "backend_class": "test_config:NoEvictionBackend"}
    with pytest.raises(ConfigError) as info:
        load(doc)
    assert info.value.path == "tiers[1].write.policy"
    assert "report evictions" in info.value.reason


class NoEvictionBackend(CPUBackend):
    set_eviction_listener = None  # type: ignore[assignment]


def test_file_errors_name_the_file_and_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("tiers:\n  - name: a\n   backend: cpu\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: invalid YAML at line 3"):
        load(tmp_path / "broken.yaml")
    (tmp_path / "broken.json").write_text('{"tiers": [}')
    with pytest.raises(ConfigError, match=r"broken.json: invalid JSON at line 1"):
        load(tmp_path / "broken.json")
    (tmp_path / "dup.yaml").write_text("chunk_size: 1\nchunk_size: 2\n")
    with pytest.raises(ConfigError, match="line 2: key 'chunk_size' appears twice"):
        load(tmp_path / "dup.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load(tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="expected a file path"):
        load(42)


def test_nothing_is_constructed_or_opened_while_validating() -> None:
    CountingBackend.constructed = CountingBackend.started_count = 0
    good = {"tiers": [{"backend": "counting"}, {"name": "b", "backend": "cpu"}]}
    cfg = load(good)
    assert CountingBackend.constructed == 0
    broken = {"tiers": [{"backend": "counting"}, {"backend": "cpu", "options": {"max_bytes": -1}}]}
    with pytest.raises(ConfigError):
        TieredHierarchy.from_config(broken, registry=make_registry())
    assert CountingBackend.constructed == 0
    h = TieredHierarchy(cfg)  # constructed, not started
    assert CountingBackend.constructed == 1 and CountingBackend.started_count == 0
    assert h.tiers[0].backend.started is False


def test_url_backends_fill_the_url_option() -> None:
    cfg = load({"tiers": [{"name": "remote", "backend": "fake://bucket/prefix?region=x",
                           "options": {"token": "abc"}}]})  # fmt: skip
    tier = cfg.tier("remote")
    assert tier.backend == "fake" and tier.backend_cls is FakeUrlBackend
    assert tier.url == "fake://bucket/prefix?region=x"
    assert tier.options.url == "fake://bucket/prefix?region=x"
    same = load({"tiers": [{"backend": "fake://b", "options": {"url": "fake://b"}}]})
    assert same.tiers[0].options.url == "fake://b"
    with pytest.raises(ConfigError) as info:
        load({"tiers": [{"backend": "fake://b", "options": {"url": "fake://other"}}]})
    assert info.value.path == "tiers[0].options.url"
    # a scheme-only URL for a backend without a url option is accepted (cpu://, memory://)
    assert load({"tiers": [{"backend": "memory://"}]}).tiers[0].backend == "cpu"
    # schemes are case-insensitive
    assert load({"tiers": [{"backend": "FAKE://b"}]}).tiers[0].backend == "fake"


def test_backend_class_escape_hatch() -> None:
    cfg = load({"tiers": [{"name": "mine", "backend_class": "test_hierarchy_fakes:SlowBackend",
                           "options": {"load_delay_ms": 5}}]})  # fmt: skip
    assert cfg.tiers[0].backend_cls.__name__ == "SlowBackend"
    assert cfg.tiers[0].options.load_delay_ms == 5.0
    assert (
        load({"tiers": [{"backend_class": "lmcache_core:CPUBackend"}]}).tiers[0].name
        == "cpubackend"
    )
    cases = [
        ("no.such.module:X", "cannot import 'no.such.module:X'"),
        ("lmcache_core:NoSuchClass", "cannot import"),
        ("lmcache_core", "must look like 'package.module:Class'"),
        ("lmcache_core:load_config", "not a class"),
        ("lmcache_core:Namespace", "is not a storage backend"),
    ]
    for target, message in cases:
        with pytest.raises(ConfigError) as info:
            load({"tiers": [{"backend_class": target}]})
        assert info.value.path == "tiers[0].backend_class"
        assert message in info.value.reason, info.value.reason


def test_env_references_are_resolved_and_redacted() -> None:
    doc = {
        "hash_salt": {"$env": "T_SALT"},
        "stats_dir": {"$env": "T_STATS", "default": "/tmp/lmc-stats"},
        "tiers": [
            {"name": "hot", "backend": "cpu", "options": {"max_bytes": {"$env": "T_SIZE"}}},
            {"name": "r", "backend": "fake://user:pw@host/b", "options": {"token": "plain"}},
            {"name": "e", "backend": {"$env": "T_URL"}},
        ],
    }
    env = {"T_SALT": "pepper", "T_SIZE": "2GiB", "T_URL": "fake://secret-host/x"}
    cfg = load(doc, environ=env)
    assert cfg.hash_salt == "pepper" and cfg.stats_dir == "/tmp/lmc-stats"
    assert cfg.tier("hot").options.max_bytes == 2 * 2**30
    assert cfg.tier("e").options.url == "fake://secret-host/x"
    assert dict(cfg.env_paths) == {"hash_salt": "T_SALT", "stats_dir": "T_STATS",
                                   "tiers[0].options.max_bytes": "T_SIZE",
                                   "tiers[2].backend": "T_URL"}  # fmt: skip
    shown = cfg.to_dict()
    text = json.dumps(shown)
    for secret in ("pepper", "secret-host", "plain", ":pw@"):
        assert secret not in text, secret
    assert shown["hash_salt"] == REDACTED
    assert shown["stats_dir"] == REDACTED
    assert shown["tiers"][0]["options"]["max_bytes"] == REDACTED
    assert shown["tiers"][1]["options"]["token"] == REDACTED  # kind "secret"
    assert shown["tiers"][1]["url"] == f"fake://user:{REDACTED}@host/b"
    assert shown["tiers"][2]["url"] == REDACTED
    assert cfg.to_dict(redact=False)["hash_salt"] == "pepper"
    assert "pepper" not in repr(cfg)
    with pytest.raises(ConfigError) as info:
        load(doc, environ={})
    assert info.value.path == "hash_salt" and "T_SALT is not set" in info.value.reason


def test_every_config_key_is_documented() -> None:
    text = DOCS.read_text(encoding="utf-8")
    begin = "<!-- lmcache-core:config-schema -->"
    end = "<!-- /lmcache-core:config-schema -->"
    block = text[text.index(begin) + len(begin) : text.index(end)]
    assert block.strip() == schema_markdown().strip(), (
        "docs/configuration.md is stale: run `lmcache-core config schema --write-docs "
        "docs/configuration.md`"
    )
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", block, flags=re.M))
    from lmcache_core.config import TierSettings, TopLevelSettings, WriteSettings

    for cls, prefix in ((TopLevelSettings, ""), (TierSettings, ""), (WriteSettings, "write.")):
        for name in cls.__dataclass_fields__:
            assert prefix + name in documented, f"{prefix}{name} is not documented"


# ---------------------------------------------------------------------------- hardening
FLOAT_KEYS = [
    ("stats_interval_s", None),
    ("drain_timeout_s", None),
    ("load_deadline_ms", 0),
    ("lookup_deadline_ms", 0),
    ("max_queue_latency_ms", 0),
    ("retry_backoff_ms", 0),
    ("retry_backoff_max_ms", 0),
]


@pytest.mark.parametrize("key,tier", FLOAT_KEYS)
@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), float("-inf"), "nan", "1e999", 10**400]
)
def test_float_options_reject_nan_inf_and_huge(key: str, tier: int | None, value: Any) -> None:
    """Issue 10: NaN passed every range check (a NaN drain timeout dropped pending stores)."""
    doc: dict[str, Any] = {"tiers": [{"backend": "cpu"}]}
    (doc if tier is None else doc["tiers"][tier])[key] = value
    with pytest.raises(ConfigError) as info:
        load(doc)
    assert info.value.path == (key if tier is None else f"tiers[0].{key}")


@pytest.mark.parametrize(
    "doc,path",
    [
        ({"chunk_size": 10**30}, "chunk_size"),
        ({"tiers": [{"backend": "cpu", "max_queue": -(10**30)}]}, "tiers[0].max_queue"),
        ({"tiers": [{"backend": "cpu", "options": {"max_bytes": 10**30}}]}, "tiers[0].options.max_bytes"),
        ({"tiers": [{"backend": "cpu", "options": {"max_bytes": "9" * 400 + "GiB"}}]}, "tiers[0].options.max_bytes"),
        ({"tiers": [{"backend": "cpu", "options": {"max_bytes": 10**5000}}]}, "tiers[0].options.max_bytes"),
        ({"chunk_size": "1" * 5000}, "chunk_size"),
    ],
)  # fmt: skip
def test_huge_numbers_are_config_errors(doc: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(doc)
    assert info.value.path == path
    assert len(str(info.value)) < 300  # the number is not spelled out


def test_malformed_documents_are_config_errors(tmp_path: Path) -> None:
    """Issue 10: RecursionError, OverflowError and raw ValueError escaped the loader."""
    deep: Any = {"backend": "cpu"}
    for _ in range(5000):
        deep = {"x": deep}
    cases: list[Any] = [
        {"tiers": [deep]},
        "{" + '"a":[' * 3000 + "]" * 3000 + "}",  # inline JSON nested too deeply
    ]
    for doc in cases:
        with pytest.raises(ConfigError):
            load(doc)
    texts = {
        "deep.yaml": "tiers: " + "[" * 3000 + "]" * 3000,
        "int.yaml": "chunk_size: " + "1" * 5000,
        "date.yaml": "chunk_size: 2001-02-30",
        "int.json": '{"chunk_size": ' + "1" * 5000 + "}",
        "self.yaml": "tiers: &a [*a]",
    }
    for name, text in texts.items():
        p = tmp_path / name
        p.write_text(text)
        with pytest.raises(ConfigError):
            load_config(p, registry=make_registry())


def test_yaml_alias_expansion_is_bounded(tmp_path: Path) -> None:
    """Each level repeats the one before ten times: 10**6 values from a few hundred bytes."""
    lines = ['l0: &l0 ["xxxxxxxxxx"]']
    for i in range(1, 7):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]")
    lines.append("tiers: [{backend: cpu, options: {max_bytes: 1GiB}}]")
    p = tmp_path / "bomb.yaml"
    p.write_text("\n".join(lines))
    with pytest.raises(ConfigError) as info:
        load_config(p, registry=make_registry())
    assert "expands to more than" in info.value.reason


@pytest.mark.parametrize(
    "url", ["fake://u:hunter22@host:99999/x", "fake://u:hunter22@host:port/x", "fake://u:hunter22@[::1/x"]
)  # fmt: skip
def test_bad_urls_are_config_errors_without_their_password(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        load({"tiers": [{"name": "r", "backend": url}]})
    assert info.value.path == "tiers[0].backend"
    assert "hunter22" not in str(info.value)
    from lmcache_core.config import redact_url

    assert "hunter22" not in redact_url(url)  # never raises, even on a bad port


def _chain(exc: BaseException | None) -> str:
    out = ""
    while exc is not None:
        out += f"{exc!s} | {exc!r} | "
        exc = exc.__cause__ or exc.__context__
    return out


def test_env_values_are_never_echoed_in_errors() -> None:
    """Issue 10: a $env value that failed validation was quoted in the error."""
    env = {"T_SIZE": "hunter22-size", "T_NUM": "hunter22", "T_CHOICE": "hunter22-policy"}
    docs = [
        {"tiers": [{"backend": "cpu", "options": {"max_bytes": {"$env": "T_SIZE"}}}]},
        {"chunk_size": {"$env": "T_NUM"}},
        {"stats_interval_s": {"$env": "T_NUM"}},
        {"tiers": [{"backend": "cpu", "write": {"policy": {"$env": "T_CHOICE"}}}]},
        {"tiers": [{"backend": {"$env": "T_CHOICE"}}]},
        {"hash_salt": {"$env": "T_NUM"}, "tiers": [{"backend": "nope-hunter22"}]},
    ]
    for doc in docs:
        with pytest.raises(ConfigError) as info:
            load(doc, environ=env)
        assert info.value.path, info.value
        assert "hunter22" not in _chain(info.value), _chain(info.value)


def test_repr_of_config_objects_hides_every_secret() -> None:
    """Issue 10: repr() showed secret options, URL passwords and $env values."""
    doc = {
        "hash_salt": "pepper-salt",
        "stats_dir": {"$env": "T_STATS"},
        "tiers": [
            {"name": "hot", "backend": "cpu", "options": {"max_bytes": {"$env": "T_SIZE"}}},
            {"name": "r", "backend": "fake://user:hunter22@host/b", "options": {"token": "tok-abcdef"}},
            {"name": "e", "backend": {"$env": "T_URL"}},
        ],
    }  # fmt: skip
    env = {"T_STATS": "/srv/hidden-stats", "T_SIZE": "2GiB", "T_URL": "fake://secret-host/x"}
    cfg = load(doc, environ=env)
    texts = [repr(cfg), str(cfg), repr(cfg.tiers), repr(cfg.tier("r").options)]
    texts += [repr(t) for t in cfg.tiers]
    for text in texts:
        for secret in ("pepper-salt", "hidden-stats", "hunter22", "tok-abcdef", "secret-host"):
            assert secret not in text, (secret, text)
    assert "2GiB" not in repr(cfg.tier("hot")) and str(2 * 2**30) not in repr(cfg.tier("hot"))
    assert "fake://user:" in repr(cfg.tier("r"))  # the rest of the URL is still shown


def test_backend_class_is_imported_only_when_asked(tmp_path: Path, monkeypatch: Any) -> None:
    """`config check` promises to open nothing: importing a module runs its code."""
    marker = tmp_path / "imported"
    (tmp_path / "side_effect_backend.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom lmcache_core import CPUBackend as Backend\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    doc = {"tiers": [{"name": "mine", "backend_class": "side_effect_backend:Backend",
                      "options": {"max_bytes": "nonsense", "token": "tok-abcdef"}}]}  # fmt: skip
    cfg = load(doc, import_backend_classes=False)
    assert not marker.exists()
    assert cfg.tier("mine").backend == "side_effect_backend:Backend"
    assert "tok-abcdef" not in repr(cfg) and "tok-abcdef" not in json.dumps(cfg.to_dict())
    with pytest.raises(ConfigError, match="not imported"):
        cfg.tier("mine").create_backend()
    with pytest.raises(ConfigError) as info:
        load({"tiers": [{"backend_class": "not a class path"}]}, import_backend_classes=False)
    assert info.value.path == "tiers[0].backend_class"
    with pytest.raises(ConfigError) as info:
        load(doc)  # imported (the default): its options are validated
    assert marker.exists() and info.value.path == "tiers[0].options.token"


def test_resolved_classes_take_their_defaults_from_the_schema():
    """Each default is declared once: CacheConfig/TierConfig mirror the settings' keys."""
    import dataclasses

    from lmcache_core.config import (
        CacheConfig,
        TierConfig,
        TierSettings,
        TopLevelSettings,
        WriteSettings,
    )

    resolved = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
    for f in dataclasses.fields(TopLevelSettings):
        if f.name not in ("tiers", "namespace"):
            assert resolved[f.name] == f.default, f.name
    resolved = {f.name: f.default for f in dataclasses.fields(TierConfig)}
    for f in dataclasses.fields(TierSettings):
        if f.name not in ("name", "backend", "options", "write"):
            assert resolved[f.name] == f.default, f.name
    for f in dataclasses.fields(WriteSettings):
        key = "write_policy" if f.name == "policy" else f.name
        assert resolved[key] == f.default, f.name


def test_the_pages_first_example_loads() -> None:
    """docs/configuration.md opens with a full configuration: it must load as written
    (the real disk and s3 backends validate their options)."""
    pytest.importorskip("lmcache_backend_disk", reason="lmcache-backend-disk is not installed")
    pytest.importorskip("lmcache_backend_s3", reason="lmcache-backend-s3 is not installed")
    text = DOCS.read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(.*?)```", text, flags=re.S)
    assert block is not None
    env = {"LMCACHE_SALT": "s", "S3_KEY_ID": "k", "S3_SECRET": "x"}
    cfg = load_config(yaml.safe_load(block.group(1)), environ=env)
    assert [t.name for t in cfg.tiers] == ["hot", "warm", "shared"]
    assert [t.backend for t in cfg.tiers] == ["cpu", "disk", "s3"]
    assert cfg.tiers[2].write_policy == "through" and cfg.tiers[2].admit_after == 2
