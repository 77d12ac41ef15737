"""ChunkedTokenDatabase: chunking, chaining, stability, salts, extra keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lmcache_core import ChunkedTokenDatabase, Namespace

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
