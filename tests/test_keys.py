"""CacheEngineKey and Namespace."""

from __future__ import annotations

import pickle
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_core import CacheEngineKey, KeyFormatError, Namespace
from lmcache_core.keys import escape_part, unescape_part

SPECIALS = "@/%=~ \t\n\x00\x7f\x85é漢🙂"
text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)) | st.sampled_from(SPECIALS))
tags = st.dictionaries(text, text, max_size=4)


@st.composite
def keys(draw: st.DrawFn) -> CacheEngineKey:
    ws = draw(st.integers(1, 64))
    return CacheEngineKey(
        draw(text),
        ws,
        draw(st.integers(0, ws - 1)),
        draw(st.integers(0, (1 << 256) - 1)),
        draw(text),
        draw(tags),
    )


@settings(max_examples=400)
@given(keys())
def test_string_round_trip_is_lossless(key: CacheEngineKey) -> None:
    s = key.to_string()
    back = CacheEngineKey.from_string(s)
    assert back == key
    assert hash(back) == hash(key)
    assert back.to_string() == s
    assert (back.model_name, back.dtype, back.tags) == (key.model_name, key.dtype, key.tags)
    # five fixed parts plus one per tag: escaped parts never contain a bare separator
    assert s.count("@") == 4 + len(key.tags)


@settings(max_examples=200)
@given(keys())
def test_path_is_safe_and_stable(key: CacheEngineKey) -> None:
    p = key.to_path()
    assert set(p) <= set(string.hexdigits.lower() + "/")
    assert not p.startswith("/") and ".." not in p
    assert len(p) == 38
    assert p == CacheEngineKey.from_string(key.to_string()).to_path()


@given(text)
def test_escape_round_trip(value: str) -> None:
    esc = escape_part(value)
    assert "@" not in esc and "=" not in esc
    assert unescape_part(esc) == value


def test_plain_form() -> None:
    k = CacheEngineKey("llama", 2, 1, 0xABC, "bfloat16", {"lora": "x", "a": "b"})
    assert k.to_string() == "llama@2@1@" + "0" * 29 + "abc@bfloat16@a=b@lora=x"


def test_request_configs_excluded_from_identity() -> None:
    a = CacheEngineKey("m", 1, 0, 5, "f", request_configs={"priority": 1})
    b = CacheEngineKey("m", 1, 0, 5, "f", request_configs={"priority": 9})
    assert a == b and hash(a) == hash(b)
    assert a.to_string() == b.to_string()
    assert a.request_configs == {"priority": 1}
    assert {a: 1}[b] == 1


def test_immutable() -> None:
    k = CacheEngineKey("m", 1, 0, 5, "f")
    with pytest.raises(AttributeError):
        k.chunk_hash = 7  # type: ignore[misc]
    with pytest.raises(AttributeError):
        k.foo = 1  # type: ignore[attr-defined]


def test_pickle_round_trip_keeps_request_configs() -> None:
    k = CacheEngineKey("m", 4, 3, 5, "f", {"t": "v"}, request_configs={"a": 1})
    back = pickle.loads(pickle.dumps(k))
    assert back == k and back.request_configs == {"a": 1}


def test_bytes_hash_and_worker_variants() -> None:
    k = CacheEngineKey("m", 1, 0, b"\x01\x02", "f")
    assert k.chunk_hash == 0x0102
    w = k.with_worker(1, 2)
    assert (w.worker_id, w.world_size, w.chunk_hash) == (1, 2, k.chunk_hash)
    assert w != k


@pytest.mark.parametrize(
    ("text_", "part"),
    [
        ("m@1@0@" + "0" * 32, "at least 5"),
        ("m@x@0@" + "0" * 32 + "@f", "world_size"),
        ("m@01@0@" + "0" * 32 + "@f", "world_size"),
        ("m@1@-1@" + "0" * 32 + "@f", "worker_id"),
        ("m@1@0@" + "0" * 31 + "@f", "hash"),
        ("m@1@0@" + "0" * 31 + "G@f", "hash"),
        ("m@1@0@" + "A" * 32 + "@f", "hash"),
        ("m@1@0@" + "0" * 64 + "@f", "hash"),
        ("m%4@1@0@" + "0" * 32 + "@f", "model"),
        ("m%41@1@0@" + "0" * 32 + "@f", "model"),
        ("m@1@0@" + "0" * 32 + "@f%ZZ", "dtype"),
        ("m@1@0@" + "0" * 32 + "@f@notag", "tag"),
        ("m@1@0@" + "0" * 32 + "@f@b=1@a=2", "sorted"),
        ("m@1@0@" + "0" * 32 + "@f@a=1@a=2", "twice"),
        ("m@1@2@" + "0" * 32 + "@f", "worker_id"),
        ("m%FF@1@0@" + "0" * 32 + "@f", "UTF-8"),
    ],
)
def test_malformed_strings_name_the_bad_part(text_: str, part: str) -> None:
    with pytest.raises(KeyFormatError) as info:
        CacheEngineKey.from_string(text_)
    assert isinstance(info.value, ValueError)
    assert part in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"world_size": 0},
        {"worker_id": 3},
        {"chunk_hash": -1},
        {"chunk_hash": 1 << 256},
        {"chunk_hash": "abc"},
        {"model_name": 5},
        {"model_name": "\ud800"},
        {"tags": [("a", "b", "c")]},
    ],
)
def test_invalid_fields_raise(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {
        "model_name": "m",
        "world_size": 2,
        "worker_id": 0,
        "chunk_hash": 1,
        "dtype": "f",
    }
    args.update(kwargs)
    with pytest.raises(KeyFormatError):
        CacheEngineKey(**args)  # type: ignore[arg-type]


def test_namespace_json_and_digest() -> None:
    ns = Namespace(model_name="m", block_size=16, chunk_size=256, extra={"vllm_hash": "sha256"})
    text_ = ns.to_json()
    assert Namespace.from_json(text_) == ns
    assert ns.digest() == Namespace.from_json(text_).digest()
    assert len(ns.digest()) == 16
    assert ns.digest() != Namespace(model_name="m", block_size=16, chunk_size=128).digest()
    assert '"format_version":2' in text_  # NAMESPACE_VERSION (typed extra keys, issue 10)
    for field in ("model_revision", "kv_layout", "hash_algorithm", "hash_salt_id", "codec"):
        assert f'"{field}"' in text_


def test_namespace_rejects_bad_input() -> None:
    with pytest.raises(KeyFormatError):
        Namespace.from_json('{"model_name": "m", "bogus": 1}')
    with pytest.raises(KeyFormatError):
        Namespace.from_json("not json")
    with pytest.raises(KeyFormatError):
        Namespace(chunk_size=-1)


def test_key_size_limit() -> None:
    from lmcache_core.keys import MAX_KEY_BYTES, check_key_size

    check_key_size(CacheEngineKey("m" * 5000, 1, 0, 1, "bf16"))  # fine: well under the limit
    check_key_size(CacheEngineKey("m" * (MAX_KEY_BYTES - 100), 1, 0, 1, "bf16"))  # just fits
    too_long = CacheEngineKey("m", 1, 0, 1, "bf16", {"t": "@" * (MAX_KEY_BYTES // 3)})
    with pytest.raises(KeyFormatError, match="longer than"):
        check_key_size(too_long)  # each '@' is escaped to 3 characters


def test_namespace_limits() -> None:
    with pytest.raises(KeyFormatError):
        Namespace(model_name="m" * (300 << 10))
    with pytest.raises(KeyFormatError):
        Namespace(chunk_size=10**5000)
    with pytest.raises(KeyFormatError):
        Namespace(model_name="\ud800")  # not encodable: it could never be hashed or stored
