"""TierPlacement / ChainBook: the glue between a hierarchy's tier and its policy."""

from __future__ import annotations

import pytest

from lmcache_core.placement.wiring import (
    BUILTIN_FACTORIES,
    ChainBook,
    PolicyContext,
    TierPlacement,
)

MB = 1 << 20


def _tp(name: str, capacity: int | None = 4 * MB, **opts: object) -> TierPlacement:
    book = ChainBook(chunk_tokens=256)
    ctx = PolicyContext("cpu", capacity, MB, capacity is None, opts)
    return TierPlacement(BUILTIN_FACTORIES[name](ctx), book, MB, capacity is not None)


def test_chain_book_learns_parent_and_position_from_lookups() -> None:
    book = ChainBook(chunk_tokens=128, capacity=4)
    book.learn(["a", "b", "c"])
    info = book.info("c", 10)
    assert (info.parent, info.position, info.start_token, info.tokens, info.nbytes) == (
        "b",
        2,
        256,
        128,
        10,
    )
    assert book.info("zzz", 5).parent is None  # never looked up: a chain's first chunk
    book.learn(["d", "e", "f"])  # bounded: the least recent go first
    assert book.info("a", 1).parent is None and book.info("f", 1).parent == "e"


def test_cost_policy_refuses_a_chunk_whose_parent_is_not_resident() -> None:
    tp = _tp("cost")
    tp.book.learn(["a", "b"])
    tp.looked_up(["a", "b"], [False, False])
    assert not tp.admits("b", MB)  # "a" is not in the tier: "b" could never be served
    assert tp.admits("a", MB)
    tp.stored("a", MB)
    assert tp.admits("b", MB)


def test_lookup_hits_and_misses_keep_residency_in_step() -> None:
    tp = _tp("lru")
    tp.looked_up(["x"], [True])  # stored by another process: now known resident
    assert tp.selector()({"x"}, MB) == ["x"]
    tp.looked_up(["x"], [False])  # gone (a shared tier's own eviction)
    assert tp.selector()({"x"}, MB) == []


def test_selector_returns_only_offered_candidates() -> None:
    tp = _tp("lru")
    for k in ("a", "b", "c"):
        tp.stored(k, MB)
    sel = tp.selector()
    assert sel({"b", "c"}, MB) == ["b"]  # "a" is pinned or in flight: not offered
    assert sel(["c"], MB) == ["c"]
    tp.removed("b")
    assert sel({"b", "c"}, MB) == ["c"]


def test_cost_factory_rejects_unknown_options() -> None:
    with pytest.raises(ValueError, match=r"unknown option.*bogus"):
        _tp("cost", bogus=1)
    assert _tp("cost", tokens_per_s=100.0, half_life=50.0).policy.name == "cost"
