"""Fuzzing the configuration loader: whatever the document, only ``ConfigError`` escapes,
and no error, ``repr()`` or ``to_dict()`` ever shows a secret.

Documents come from three sources: arbitrary JSON-like values, near-valid configurations
(every schema key, hostile values: NaN, huge numbers, bad URLs, deep nesting, ``$env``
references), and YAML text (dumped documents, then mutated; alias structures).
Hypothesis runs with a fixed seed (``derandomize``) and a fixed number of examples.
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from core_faults import FULL, make_registry, report
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_core import CacheConfig, ConfigError, load_config

MARK = "zzSECRETzz"
ENV = {
    "T_PASS": f"pw-{MARK}",
    "T_URL": f"fake://user:{MARK}@host:99999/x",
    "T_PATH": f"/srv/{MARK}/kv",
    "T_NUM": f"12{MARK}",
    "T_SIZE": "2GiB",
}
REGISTRY = make_registry()
EXAMPLES = 4000 if FULL else 250
SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
SEEN = {"ok": 0, "config_error": 0}

KEYS = [
    "chunk_size", "hash_algorithm", "hash_salt", "stats_dir", "stats_interval_s",
    "drain_timeout_s", "tiers", "name", "backend", "backend_class", "options", "write",
    "promote", "load_deadline_ms", "lookup_deadline_ms", "max_queue", "max_queue_latency_ms",
    "write_concurrency", "retry_backoff_ms", "retry_backoff_max_ms", "policy", "admit_after",
    "max_bytes", "pin_memory", "inline_copy_bytes", "yield_every_bytes", "label", "$env",
    "default", "url", "token", "path",
]  # fmt: skip
NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.sampled_from([0, 1, -1, 2**63, 2**64]),
    st.sampled_from(["huge", "negative-huge"]).map(  # not spelled out in reprs
        lambda which: 10**5000 if which == "huge" else -(10**400)
    ),
    st.floats(allow_nan=True, allow_infinity=True),
)
TEXTS = st.one_of(
    st.text(max_size=20),
    st.sampled_from(
        [
            "cpu", "down", "nope", "through", "back", "none", "auto", "xxh3_128", "sha256",
            "8GiB", "1e999", "nan", "-inf", "9" * 400, "1" * 5000, "0.5", "lots",
            "fake://u:pw@h:99999/x", "fake://u:pw@h:port/x", "fake://[::1/x", "fake://h/x",
            "file:///tmp/x", "s3://b/k", "pkg.mod:Cls", "os:system", "bad class",
            "\x00", "~/x", "/", "", "a" * 300,
        ]
    ),
)  # fmt: skip
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXTS)
ENV_REFS = st.builds(
    lambda name, default: {"$env": name, **({"default": default} if default else {})},
    st.sampled_from([*ENV, "T_UNSET", ""]),
    st.one_of(st.none(), TEXTS),
)
VALUES = st.recursive(
    st.one_of(SCALARS, ENV_REFS),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=8)), inner, max_size=5),
    ),
    max_leaves=25,
)


def tier() -> st.SearchStrategy[dict[str, Any]]:
    fields = {
        "name": st.one_of(TEXTS, st.just("t")),
        "backend": st.one_of(
            st.sampled_from(["cpu", "down", "fake://u:pw@h/x", "nope"]), TEXTS, ENV_REFS
        ),
        "backend_class": st.one_of(TEXTS, st.just("lmcache_core:CPUBackend")),
        "options": st.one_of(
            st.dictionaries(st.sampled_from(KEYS), st.one_of(SCALARS, ENV_REFS), max_size=4),
            VALUES,
        ),
        "write": st.one_of(
            st.fixed_dictionaries(
                {}, optional={"policy": st.one_of(TEXTS, ENV_REFS), "admit_after": NUMBERS}
            ),
            VALUES,
        ),
        **{k: st.one_of(NUMBERS, TEXTS, ENV_REFS, st.none()) for k in KEYS[11:20]},
        "promote": st.one_of(st.booleans(), TEXTS),
    }
    return st.fixed_dictionaries({}, optional=fields)


NEAR_VALID = st.fixed_dictionaries(
    {"tiers": st.lists(tier(), max_size=3)},
    optional={k: st.one_of(SCALARS, ENV_REFS) for k in KEYS[:6]},
)


def deep(depth: int) -> Any:
    doc: Any = {"backend": "cpu"}
    for _ in range(depth):
        doc = {"options": doc}
    return {"tiers": [doc]}


def mutate(text: str, data: st.DataObject) -> str:
    for _ in range(data.draw(st.integers(0, 4))):
        if not text:
            break
        i = data.draw(st.integers(0, len(text) - 1))
        op = data.draw(st.sampled_from(["del", "dup", "ins"]))
        if op == "del":
            text = text[:i] + text[i + 1 :]
        elif op == "dup":
            text = text[:i] + text[i:] * 2
        else:
            text = text[:i] + data.draw(st.sampled_from(list("[]{}&*:!- \n'\"#|>%@"))) + text[i:]
    return text


def aliases(levels: int, fan: int) -> str:
    lines = ['a0: &a0 ["x"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fan)}]")
    return "\n".join(lines) + "\ntiers: [{backend: cpu}]\n"


def check(doc: Any) -> None:
    """The property: a CacheConfig or a ConfigError, and no secret anywhere."""
    try:
        cfg = load_config(doc, registry=REGISTRY, environ=ENV, import_backend_classes=False)
    except ConfigError as exc:
        SEEN["config_error"] += 1
        text = f"{exc} {exc!r} {exc.path}"
        linked = exc.__cause__ or exc.__context__
        while linked is not None:
            text += f" {linked} {linked!r}"
            linked = linked.__cause__ or linked.__context__
        assert MARK not in text, text
        return
    SEEN["ok"] += 1
    assert isinstance(cfg, CacheConfig)
    shown = repr(cfg) + json.dumps(cfg.to_dict(), default=str)
    assert MARK not in shown, shown


@SETTINGS
@given(VALUES)
def test_any_value(doc: Any) -> None:
    check(doc)


@SETTINGS
@given(NEAR_VALID)
def test_near_valid_configs(doc: Any) -> None:
    check(doc)


@SETTINGS
@given(st.one_of(NEAR_VALID, VALUES), st.data())
def test_yaml_text(doc: Any, data: st.DataObject) -> None:
    try:
        text = yaml.safe_dump(doc)
    except (yaml.YAMLError, ValueError):
        return
    check("{" + json.dumps(doc, default=str)[1:] if isinstance(doc, dict) else text)
    check_text(mutate(text, data))


def check_text(text: str) -> None:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        p.write_text(text, encoding="utf-8", errors="surrogatepass")
        check(p)


def test_shapes_that_broke_the_loader() -> None:
    """Deep nesting, alias bombs and recursive aliases: fast ConfigErrors."""
    import time

    t0 = time.perf_counter()
    for doc in (deep(50), deep(5000)):
        check(doc)
    for levels, fan in ((9, 10), (30, 2), (4, 50)):
        check_text(aliases(levels, fan))
    check_text("tiers: &a [*a]")
    check_text("tiers: " + "[" * 5000 + "]" * 5000)
    assert time.perf_counter() - t0 < 10.0
    report("config loader fuzzing", examples_per_test=EXAMPLES, **SEEN, other_exceptions=0)
