"""ChunkedTokenDatabase: chunking, chaining, stability, salts, extra keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lmcache_core import (
    NAMESPACE_VERSION,
    ChunkedTokenDatabase,
    Namespace,
    TokenInputError,
    TokenTypeError,
)
from lmcache_core.token_db import encode_extra_keys

TOKENS = list(range(1000, 1100))


def hashes(db: ChunkedTokenDatabase, tokens: object, **kw: object) -> list[int]:
    return [k.chunk_hash for _, _, k in db.process_tokens(tokens, **kw)]  # type: ignore[arg-type]


def test_defaults_and_ranges() -> None:
    db = ChunkedTokenDatabase(chunk_size=8)
    out = list(db.process_tokens(TOKENS[:20]))
    assert [(s, e) for s, e, _ in out] == [(0, 8), (8, 16)]
    out = list(db.process_tokens(TOKENS[:20], save_unfull_chunk=True))
    assert [(s, e) for s, e, _ in out] == [(0, 8), (8, 16), (16, 20)]
    assert ChunkedTokenDatabase().chunk_size == 256
    assert list(db.process_tokens([])) == []
    assert db.num_chunks(20) == 2


def test_input_types_agree() -> None:
    db = ChunkedTokenDatabase(chunk_size=16)
    ref = hashes(db, TOKENS)
    assert hashes(db, tuple(TOKENS)) == ref
    for dtype in (np.int32, np.int64, np.uint32):
        assert hashes(db, np.array(TOKENS, dtype=dtype)) == ref
    assert hashes(db, torch.tensor(TOKENS)) == ref
    assert hashes(db, torch.tensor(TOKENS, dtype=torch.int32)) == ref
    assert hashes(db, np.array(TOKENS, dtype=">i4")) == ref


def test_prefix_chaining() -> None:
    db = ChunkedTokenDatabase(chunk_size=10)
    a = hashes(db, TOKENS)
    changed = list(TOKENS)
    changed[25] += 1
    b = hashes(db, changed)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    # same chunk content after a different prefix gives a different key
    assert hashes(db, TOKENS[10:20])[0] != a[1]


def test_namespace_and_settings_change_keys() -> None:
    base = hashes(ChunkedTokenDatabase(chunk_size=10), TOKENS)
    assert hashes(ChunkedTokenDatabase(chunk_size=10, model_name="other"), TOKENS) != base
    assert hashes(ChunkedTokenDatabase(chunk_size=10, hash_algorithm="sha256"), TOKENS) != base
    ns = Namespace(model_name="m", chunk_size=10, model_revision="abc")
    ns2 = Namespace(model_name="m", chunk_size=10, model_revision="abd")
    assert hashes(ChunkedTokenDatabase(namespace=ns), TOKENS) != hashes(
        ChunkedTokenDatabase(namespace=ns2), TOKENS
    )


def test_sha256_keys_are_256_bit() -> None:
    db = ChunkedTokenDatabase(chunk_size=10, hash_algorithm="sha256")
    keys = db.keys(TOKENS)
    assert any(k.chunk_hash >= 1 << 128 for k in keys)
    assert all(len(k.chunk_hash_hex) in (32, 64) for k in keys)


def test_salt_makes_a_keyed_hash() -> None:
    plain = hashes(ChunkedTokenDatabase(chunk_size=10), TOKENS)
    s1 = hashes(ChunkedTokenDatabase(chunk_size=10, hash_salt=b"tenant-a"), TOKENS)
    s1b = hashes(ChunkedTokenDatabase(chunk_size=10, hash_salt="tenant-a"), TOKENS)
    s2 = hashes(ChunkedTokenDatabase(chunk_size=10, hash_salt=b"tenant-b"), TOKENS)
    assert s1 == s1b
    assert len({tuple(plain), tuple(s1), tuple(s2)}) == 3
    db = ChunkedTokenDatabase(chunk_size=10, hash_salt=b"tenant-a")
    assert db.namespace.hash_salt_id == ChunkedTokenDatabase.salt_id(b"tenant-a")
    assert "tenant-a" not in db.namespace.to_json()
    with pytest.raises(ValueError):
        ChunkedTokenDatabase(chunk_size=10, hash_salt=b"")


def test_mask_skips_computed_prefix() -> None:
    db = ChunkedTokenDatabase(chunk_size=10)
    full = list(db.process_tokens(TOKENS))
    mask = [False] * 30 + [True] * 70
    part = list(db.process_tokens(TOKENS, mask=mask))
    assert part == full[3:]
    mask2 = [False] * 35 + [True] * 65  # a partly computed chunk is still yielded
    assert list(db.process_tokens(TOKENS, mask=mask2)) == full[3:]
    with pytest.raises(ValueError):
        list(db.process_tokens(TOKENS, mask=[True] * 10 + [False] * 90))
    with pytest.raises(ValueError):
        list(db.process_tokens(TOKENS, mask=[True] * 5))


def test_extra_keys() -> None:
    db = ChunkedTokenDatabase(chunk_size=10)
    plain = hashes(db, TOKENS)
    per_chunk = [None] * 10
    assert hashes(db, TOKENS, extra_keys=per_chunk) == plain
    per_chunk[4] = ("lora", 7)
    with_lora = hashes(db, TOKENS, extra_keys=per_chunk)
    assert with_lora[:4] == plain[:4] and with_lora[4] != plain[4] and with_lora[5] != plain[5]

    def mm(start: int, end: int) -> object:
        return [("img", "abc", 12)] if start <= 12 < end else None

    via_fn = hashes(db, TOKENS, extra_keys=mm)
    assert via_fn[0] == plain[0] and via_fn[1] != plain[1]
    # distinct values never encode alike
    a = hashes(db, TOKENS, extra_keys=[b"ab"] + [None] * 9)
    b = hashes(db, TOKENS, extra_keys=["ab"] + [None] * 9)
    assert a[0] != b[0]


def test_tokens_out_of_int32_range_are_rejected() -> None:
    db = ChunkedTokenDatabase(chunk_size=2)
    with pytest.raises(ValueError):
        list(db.process_tokens([1, 2**31]))
    with pytest.raises(ValueError):
        list(db.process_tokens(np.array([1, 2**40], dtype=np.int64)))
    with pytest.raises(ValueError):
        list(db.process_tokens(np.array([1.0, 2.0])))


def test_key_fields() -> None:
    db = ChunkedTokenDatabase(
        chunk_size=4,
        model_name="m",
        world_size=2,
        worker_id=1,
        dtype="bfloat16",
        tags={"lora": "x"},
    )
    k = db.keys(TOKENS)[0]
    assert (k.model_name, k.world_size, k.worker_id, k.dtype, k.tags) == (
        "m",
        2,
        1,
        "bfloat16",
        (("lora", "x"),),
    )
    other = db.for_worker(0)
    k0 = other.keys(TOKENS)[0]
    assert k0.chunk_hash == k.chunk_hash and k0.worker_id == 0


def test_namespace_disagreement_raises() -> None:
    with pytest.raises(ValueError):
        ChunkedTokenDatabase(chunk_size=8, namespace=Namespace(chunk_size=16))
    with pytest.raises(ValueError):
        ChunkedTokenDatabase(hash_algorithm="md5")
    with pytest.raises(ValueError):
        ChunkedTokenDatabase(chunk_size=0)


def test_keys_from_block_hashes() -> None:
    db = ChunkedTokenDatabase(chunk_size=32)
    blocks = [os.urandom(32) for _ in range(8)]
    keys = db.keys_from_block_hashes(blocks, block_size=16)
    assert len(keys) == 4
    again = db.keys_from_block_hashes(list(blocks), block_size=16)
    assert keys == again
    changed = list(blocks)
    changed[3] = os.urandom(32)
    k2 = db.keys_from_block_hashes(changed, block_size=16)
    assert k2[0] == keys[0] and k2[1] != keys[1]
    assert db.keys_from_block_hashes([1, 2, 3, 4], block_size=16)[0] != keys[0]
    with pytest.raises(ValueError):
        db.keys_from_block_hashes(blocks, block_size=12)


_CHILD = """
import json, sys
from lmcache_core import ChunkedTokenDatabase
out = {}
for algo in ("xxh3_128", "sha256"):
    db = ChunkedTokenDatabase(chunk_size=16, model_name="m", hash_algorithm=algo)
    out[algo] = [k.to_string() for k in db.keys(list(range(100)))]
salted = ChunkedTokenDatabase(chunk_size=16, hash_salt="s")
out["salted"] = [k.to_string() for k in salted.keys(list(range(100)))]
json.dump(out, sys.stdout)
"""


def test_stable_across_processes_and_hash_seeds() -> None:
    results = []
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
        )
        results.append(json.loads(proc.stdout))
    assert results[0] == results[1] == results[2]
    # and equal to this process's keys
    db = ChunkedTokenDatabase(chunk_size=16, model_name="m")
    assert results[0]["xxh3_128"] == [k.to_string() for k in db.keys(list(range(100)))]


def test_known_answer() -> None:
    """Pin the scheme: a change here breaks every stored cache, so it must be deliberate.

    Changed deliberately once: NAMESPACE_VERSION 1 -> 2 (issue 10, typed extra keys and
    block hashes) changed every chain's seed; under version 1 this was
    ``a6ffb5643c3d66cb060f1bfe3bb92177``, and a version-1 namespace still gives it.
    """
    db = ChunkedTokenDatabase(chunk_size=4)
    assert db.keys([1, 2, 3, 4])[0].chunk_hash_hex == KNOWN_FIRST_CHUNK
    v1 = ChunkedTokenDatabase(namespace=Namespace(chunk_size=4, format_version=1))
    assert v1.keys([1, 2, 3, 4])[0].chunk_hash_hex == "a6ffb5643c3d66cb060f1bfe3bb92177"


KNOWN_FIRST_CHUNK = "67578a1a7de94a059e98d431fff15302"


# ---------------------------------------------------------------------------- input rules
def _forms(values: list[int], dtype: str) -> list[object]:
    """The same ids as a list, a numpy array and (where torch has the dtype) a tensor."""
    out: list[object] = [list(values), tuple(values), np.array(values, dtype=dtype)]
    tdtype = getattr(torch, dtype, None)
    if tdtype is not None:
        try:
            out.append(torch.tensor(values, dtype=tdtype))
        except (RuntimeError, TypeError, OverflowError):
            pass
    return out


def test_uint32_ids_from_2_31_never_wrap() -> None:
    """Issue 10: a uint32 id >= 2**31 silently wrapped to a negative int32 (and so
    collided with that id) while a list or an int64 array raised."""
    db = ChunkedTokenDatabase(chunk_size=2)
    for form in _forms([1, 2**31], "uint32") + _forms([1, 2**32 - 1], "uint32"):
        with pytest.raises(TokenInputError):
            list(db.process_tokens(form))
    for form in _forms([1, -(2**31) - 1], "int64"):
        with pytest.raises(TokenInputError):
            list(db.process_tokens(form))
    ok = [0, 2**31 - 1, -(2**31), 7]
    ref = hashes(db, ok)
    for form in _forms(ok, "int64"):
        assert hashes(db, form) == ref
    assert hashes(db, np.array([0, 2**31 - 1], dtype=np.uint32)) == hashes(db, [0, 2**31 - 1])


def test_wrong_kinds_are_refused_in_every_form() -> None:
    """Issue 10: bools, 2-D and 0-d arrays were accepted as token ids."""
    db = ChunkedTokenDatabase(chunk_size=2)
    bad: list[object] = [
        [1, True],
        (False, 2),
        np.array([True, False]),
        torch.tensor([True, False]),
        np.array([[1, 2], [3, 4]]),
        torch.tensor([[1, 2], [3, 4]]),
        np.array(5),
        torch.tensor(5),
        [1.0, 2.0],
        np.array([1.0, 2.0]),
        torch.tensor([1.0, 2.0]),
        ["1", "2"],
        "12",
        b"\x01\x02",
        {1, 2},
        {1: 2},
        5,
        None,
        [[1, 2]],
        np.array([1, 2], dtype=object),
    ]
    for tokens in bad:
        with pytest.raises(TokenTypeError):
            list(db.process_tokens(tokens))
    assert issubclass(TokenTypeError, TypeError) and issubclass(TokenTypeError, ValueError)
    assert issubclass(TokenInputError, ValueError)
    # numpy integer scalars in a list are ints; so is a range
    assert hashes(db, [np.int64(5), np.uint16(6)]) == hashes(db, [5, 6]) == hashes(db, range(5, 7))


def test_mask_and_extra_key_errors_are_documented_ones() -> None:
    db = ChunkedTokenDatabase(chunk_size=2)
    with pytest.raises(TokenInputError):
        list(db.process_tokens([1, 2, 3, 4], mask=[True]))
    with pytest.raises(TokenTypeError):
        list(db.process_tokens([1, 2, 3, 4], mask=["a", "b", "c", "d"]))
    with pytest.raises(TokenInputError):
        db.keys([1, 2, 3, 4], extra_keys=[None])  # one entry for two chunks
    with pytest.raises(TokenTypeError):
        db.keys([1, 2], extra_keys=[{1, 2}])
    nested: list[object] = []
    nested.append(nested)  # contains itself
    with pytest.raises(TokenInputError):
        db.keys([1, 2], extra_keys=[nested])
    with pytest.raises(TokenTypeError):
        db.keys_from_block_hashes([True, False], block_size=1)
    with pytest.raises(TokenInputError):
        db.keys_from_block_hashes([-1, 2], block_size=1)


def test_distinct_extra_keys_always_encode_distinctly() -> None:
    """Issue 10: {1: "a"} and {"1": "a"} (dict keys were str()-ed) encoded alike."""
    distinct: list[object] = [
        {1: "a"},
        {"1": "a"},
        {b"1": "a"},
        {True: "a"},
        {1.0: "a"},
        {(1,): "a"},
        1,
        "1",
        b"1",
        1.0,
        True,
        [1],
        [[1]],
        {},
        [],
        "",
        b"",
        0,
        -1,
        2**64,
        -(2**64),
        None,
        [None],
    ]
    encoded = [encode_extra_keys(v) for v in distinct]
    assert len(set(encoded)) == len(distinct)
    db = ChunkedTokenDatabase(chunk_size=2)
    keys = {db.keys([1, 2], extra_keys=[v])[0] for v in distinct}
    assert len(keys) == len(distinct)
    # dict order does not matter; a list and a tuple are one sequence kind (JSON round trips)
    assert encode_extra_keys({1: "a", "b": 2}) == encode_extra_keys({"b": 2, 1: "a"})
    assert encode_extra_keys([1, (2, 3)]) == encode_extra_keys((1, [2, 3]))
    assert encode_extra_keys(10**5000)  # no int-to-text conversion limit


def test_block_hash_int_and_bytes_are_distinct() -> None:
    """Issue 10: the block hash 1 and b"\\x01" gave the same chunk key."""
    db = ChunkedTokenDatabase(chunk_size=2)
    as_int = db.keys_from_block_hashes([1, 2], block_size=1)
    as_bytes = db.keys_from_block_hashes([b"\x01", b"\x02"], block_size=1)
    assert as_int != as_bytes
    assert db.keys_from_block_hashes([bytearray(b"\x01"), b"\x02"], block_size=1) == as_bytes


def test_keys_of_the_old_scheme_never_match_the_new() -> None:
    """The namespace version seeds every chain: chunks stored under version 1 (whose
    extra keys could collide) are never looked up by version 2."""
    new = ChunkedTokenDatabase(chunk_size=4)
    old = ChunkedTokenDatabase(namespace=Namespace(chunk_size=4, format_version=1))
    assert new.namespace.format_version == NAMESPACE_VERSION == 2
    tokens = list(range(64))
    assert not set(new.keys(tokens)) & set(old.keys(tokens))
    blocks = [bytes([i]) * 8 for i in range(16)]
    assert not set(new.keys_from_block_hashes(blocks, 1)) & set(
        old.keys_from_block_hashes(blocks, 1)
    )


def test_typed_encoding_known_answers() -> None:
    """Pin the version-2 encoding of extra keys (a change breaks every stored cache)."""
    # d, 1 item; key: i, 1 byte, 0x01; value: s, 1 byte, "a"
    assert encode_extra_keys({1: "a"}).hex() == "6401000000690100000001730100000061"
    # l, 4 items: T, N, b 1 byte "x", i 1 byte -1 (two's complement)
    assert encode_extra_keys([True, None, b"x", -1]).hex() == (
        "6c04000000544e6201000000786901000000ff"
    )


# ---------------------------------------------------------------------------- hot path
def _reference_chain(db: ChunkedTokenDatabase, tokens: list[int], cs: int) -> list[int]:
    """The documented chain, written out plainly: ``h_i = xxh3_128(h_{i-1} || int32le(
    tokens_i), seed=n_i)``, for comparison with the staged hot path."""
    from xxhash import xxh3_128_digest

    p, out = db._h0, []
    for start in range(0, len(tokens) - len(tokens) % cs, cs):
        p = xxh3_128_digest(p + np.array(tokens[start : start + cs], "<i4").tobytes(), cs)
        out.append(int.from_bytes(p, "big"))
    return out


def test_staged_hot_path_matches_the_chain_across_lengths_sizes_and_threads() -> None:
    """The hot path reuses per-thread staging rows (grown to the longest prompt seen, one
    set per chunk size): a long prompt, then shorter ones, other chunk sizes and other
    threads must all give the plain chain's hashes, with masks and strided input too."""
    import threading

    rng = np.random.default_rng(7)
    dbs = {cs: ChunkedTokenDatabase(chunk_size=cs) for cs in (4, 16, 256)}
    errors: list[str] = []

    def worker(seed: int) -> None:
        r = np.random.default_rng(seed)
        for n in (4096, 100, 4096 + 17, 3, 0, 2048):
            toks = r.integers(-(2**31), 2**31, n, dtype=np.int64).tolist()
            for cs, db in dbs.items():
                ref = _reference_chain(db, toks, cs)
                for form in (toks, np.array(toks, np.int64), torch.tensor(toks, dtype=torch.int64)):
                    if hashes(db, form) != ref:
                        errors.append(f"seed {seed}, n {n}, cs {cs}, {type(form).__name__}")
                strided = np.repeat(np.array(toks, dtype=">i8"), 2)[::2]
                if hashes(db, strided) != ref:
                    errors.append(f"strided, n {n}, cs {cs}")
                k = n // 2
                mask = np.array([False] * k + [True] * (n - k), dtype=bool)
                if hashes(db, toks, mask=mask) != ref[k // cs :]:
                    errors.append(f"mask, n {n}, cs {cs}")

    threads = [threading.Thread(target=worker, args=(int(s),)) for s in rng.integers(0, 99, 3)]
    for t in threads:
        t.start()
    worker(1)
    for t in threads:
        t.join()
    assert errors == []
