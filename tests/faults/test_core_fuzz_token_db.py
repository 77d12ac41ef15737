"""Fuzzing the token database: whatever the tokens, mask, extra keys or block hashes,
the result is keys or one of the two documented errors (``TokenInputError``, a
``ValueError``; ``TokenTypeError``, also a ``TypeError``), and every input form (list,
tuple, numpy array, torch tensor) follows one rule: the same ids give the same keys, the
same bad ids the same error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from core_faults import FULL, report
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lmcache_core import ChunkedTokenDatabase, TokenInputError, TokenTypeError

EXAMPLES = 4000 if FULL else 200
SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
DB = ChunkedTokenDatabase(chunk_size=4)
DOCUMENTED = (TokenInputError, TokenTypeError)
SEEN = {"keys": 0, "TokenInputError": 0, "TokenTypeError": 0, "forms_compared": 0}

IDS = st.one_of(
    st.integers(min_value=-(2**31), max_value=2**31 - 1),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.sampled_from([2**31, -(2**31) - 1, 2**32 - 1, 0, 1]),
)
ODD = st.one_of(
    st.booleans(), st.floats(), st.text(max_size=3), st.binary(max_size=3), st.none(),
    st.lists(st.integers(0, 9), max_size=2), st.sampled_from([np.int64(3), np.uint32(2**31), np.bool_(True)]),
)  # fmt: skip
DTYPES = st.sampled_from(
    ["int8", "uint8", "int16", "uint16", ">i4", "<i4", "uint32", "int64", ">u8", "uint64",
     "bool", "float32", "float64", "complex64", "object", "U3", "S3"]
)  # fmt: skip
ARRAYS = DTYPES.flatmap(
    lambda dt: hnp.arrays(
        dtype=np.dtype(dt),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9),
        elements=None if dt not in ("object",) else st.integers(0, 9),
    )
)
TENSOR_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
                 torch.float32, torch.bfloat16] + [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]  # fmt: skip
TOKENS = st.one_of(
    st.lists(IDS, max_size=24),
    st.lists(st.one_of(IDS, ODD), max_size=10),
    st.tuples(IDS, IDS, IDS, IDS),
    ARRAYS,
    st.one_of(st.integers(), st.text(max_size=4), st.binary(max_size=4), st.none(),
              st.sets(st.integers(0, 5), max_size=3), st.dictionaries(st.integers(0, 3), st.integers(0, 3), max_size=2)),
)  # fmt: skip
EXTRA_VALUES = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4), st.binary(max_size=4),
        st.sampled_from([{1, 2}, object(), 1j, np.int64(1)]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.integers(), st.text(max_size=3), st.booleans()), inner, max_size=3),
    ),
    max_leaves=10,
)  # fmt: skip
EXTRA = st.one_of(st.none(), st.lists(EXTRA_VALUES, max_size=8), st.integers(), st.text(max_size=3))
MASK = st.one_of(
    st.none(), st.lists(st.booleans(), max_size=24), st.lists(IDS, max_size=4), st.text(max_size=2)
)


def run(call: Any) -> object:
    """``call()``'s result, or the class of a documented error (anything else fails)."""
    try:
        out = call()
    except DOCUMENTED as exc:
        SEEN[type(exc).__name__] += 1
        return type(exc)
    SEEN["keys"] += 1
    return out


@SETTINGS
@given(TOKENS, MASK, EXTRA, st.booleans())
def test_any_input_gives_keys_or_a_documented_error(
    tokens: Any, mask: Any, extra: Any, unfull: bool
) -> None:
    def keys() -> list[Any]:
        return list(
            DB.process_tokens(tokens, mask=mask, extra_keys=extra, save_unfull_chunk=unfull)
        )

    run(keys)


@SETTINGS
@given(st.lists(IDS, max_size=24), st.sampled_from(["int64", "uint32", "<i4", ">i8", "uint64"]))
def test_every_form_follows_one_rule(ids: list[int], dtype: str) -> None:
    """A list, a tuple, a numpy array and a tensor of the same ids: same keys, same error."""
    reference = run(lambda: DB.keys(ids))
    forms: list[Any] = [tuple(ids)]
    info = np.iinfo(np.dtype(dtype))
    if all(info.min <= i <= info.max for i in ids):
        forms.append(np.array(ids, dtype=dtype))
        if dtype in ("int64", ">i8"):
            forms.append(torch.tensor(ids, dtype=torch.int64))
    for form in forms:
        SEEN["forms_compared"] += 1
        assert run(lambda f=form: DB.keys(f)) == reference, (form, reference)


@SETTINGS
@given(
    st.one_of(
        st.lists(st.one_of(st.binary(max_size=9), st.integers(min_value=-3, max_value=2**70)), max_size=9),
        st.lists(ODD, max_size=4), st.text(max_size=3), st.binary(max_size=4),
    ),
    st.sampled_from([1, 2, 3, 4, 0, -1, True, 2.0]),
    EXTRA,
)  # fmt: skip
def test_block_hashes(hashes: Any, block_size: Any, extra: Any) -> None:
    run(lambda: DB.keys_from_block_hashes(hashes, block_size, extra_keys=extra))


@SETTINGS
@given(ARRAYS, st.sampled_from(TENSOR_DTYPES))
def test_tensors(arr: Any, dtype: torch.dtype) -> None:
    if arr.dtype.kind in "cOUS":
        return  # torch has no such tensors
    try:
        t = torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)
    except (TypeError, RuntimeError, ValueError, OverflowError):
        return  # a tensor torch cannot make from it
    run(lambda: DB.keys(t))


def test_report() -> None:
    report("token database fuzzing", examples_per_test=EXAMPLES, **SEEN, other_exceptions=0)
