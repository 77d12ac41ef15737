"""The optional compiled helper ``lmcache_core._speedups`` and its pure-Python fallback.

The helper converts a list or tuple of exact ints to int32 little-endian bytes and
declines (``None``) everything else; the token database must give the same keys and the
same errors with it and without it.
"""

from __future__ import annotations

import shutil
import struct
import sysconfig
from collections.abc import Iterator

import numpy as np
import pytest

from lmcache_core import ChunkedTokenDatabase, TokenInputError, TokenTypeError
from lmcache_core import token_db as tdb

try:
    from lmcache_core import _speedups
except ImportError:  # pragma: no cover - only where no C compiler was available
    _speedups = None  # type: ignore[assignment]

needs_native = pytest.mark.skipif(
    _speedups is None, reason="lmcache_core._speedups was not built (no C compiler at install)"
)


def _compiler_present() -> bool:
    cc = (sysconfig.get_config_var("CC") or "").split()
    return bool(cc) and shutil.which(cc[0]) is not None


def test_the_helper_is_built_where_a_compiler_is() -> None:
    """A broken build must not fall back silently on a machine that can compile it
    (the fallback is correct but ~3x slower on list input)."""
    if not _compiler_present():
        pytest.skip("no C compiler here: the pure-Python path is the expected one")
    assert _speedups is not None, "setup.py's optional extension failed to build"
    assert tdb._native_int32_le is _speedups.int32_le


def _pack(values: list[int]) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


@needs_native
@pytest.mark.parametrize(
    "values",
    [
        [],
        [0],
        [1, 0, 1],
        [2**31 - 1, -(2**31), -1, 7],
        list(range(-300, 300)),
        np.random.default_rng(0).integers(-(2**31), 2**31, 5000, dtype=np.int64).tolist(),
    ],
)
def test_int32_le_equals_struct(values: list[int]) -> None:
    assert _speedups.int32_le(values) == _pack(values)
    assert _speedups.int32_le(tuple(values)) == _pack(values)


class _IntSub(int):
    pass


@needs_native
@pytest.mark.parametrize(
    "values",
    [
        [1, True],  # bools are refused by the Python path: never packed here
        [False],
        [1, 2**31],
        [-(2**31) - 1],
        [2**63],
        [-(2**200)],
        [1, np.int64(2)],  # numpy scalars: the Python path takes them
        [1, _IntSub(3)],
        [1.0],
        ["1"],
        [None],
    ],
)
def test_int32_le_declines_what_it_does_not_own(values: list[object]) -> None:
    assert _speedups.int32_le(values) is None
    assert _speedups.int32_le(tuple(values)) is None


@needs_native
def test_int32_le_declines_other_sequences() -> None:
    class MyList(list[int]):
        pass

    for seq in (MyList([1, 2]), range(3), np.arange(3), b"\x01\x02", iter([1, 2]), {1: 2}):
        assert _speedups.int32_le(seq) is None


@pytest.fixture(params=["native", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "native":
        if _speedups is None:
            pytest.skip("lmcache_core._speedups was not built (no C compiler at install)")
        monkeypatch.setattr(tdb, "_native_int32_le", _speedups.int32_le)
    else:
        monkeypatch.setattr(tdb, "_native_int32_le", None)
    yield request.param


def _keys(tokens: object, chunk: int = 16) -> list[int]:
    db = ChunkedTokenDatabase(chunk_size=chunk, model_name="m")
    return [k.chunk_hash for _, _, k in db.process_tokens(tokens, save_unfull_chunk=True)]


def test_keys_are_the_same_on_both_paths_and_for_every_input_form(path: str) -> None:
    rng = np.random.default_rng(1)
    for n in (0, 1, 15, 16, 17, 100, 1000):
        arr = rng.integers(-(2**31), 2**31, n, dtype=np.int64)
        want = _keys(arr.astype(np.int32))
        assert _keys(arr.tolist()) == want
        assert _keys(tuple(arr.tolist())) == want
        # numpy scalars in a list: declined by the helper, packed by the struct path
        assert _keys([np.int64(v) for v in arr.tolist()]) == want


def test_errors_are_the_same_on_both_paths(path: str) -> None:
    with pytest.raises(TokenTypeError, match="bool"):
        _keys([1, 2, True])
    with pytest.raises(TokenTypeError, match="bool"):
        _keys([np.bool_(True)] + [1] * 20)
    with pytest.raises(TokenTypeError):
        _keys([1, 2.0])
    with pytest.raises(TokenTypeError):
        _keys([1, "2"])
    with pytest.raises(TokenInputError, match="int32 range"):
        _keys([1, 2**31])
    with pytest.raises(TokenInputError, match="int32 range"):
        _keys((-(2**31) - 1,))
    with pytest.raises(TokenInputError, match="int32 range"):
        _keys([2**80])


def test_a_large_prompt_in_chunks_of_256(path: str) -> None:
    """The benchmarked shape (32k tokens, 256-token chunks), both paths, against the
    array path (which never uses the helper)."""
    arr = np.random.default_rng(2).integers(0, 128_000, 32_768, dtype=np.int64)
    assert _keys(arr.tolist(), 256) == _keys(arr, 256)
