"""The quality scoring of ``bench codecs --model`` on runs written by hand (the engine
runs themselves start vLLM: docs/codecs.md's command exercises them)."""

from __future__ import annotations

import math

import pytest

from lmcache_core.cli.codec_quality import QualityRun, format_quality, score_runs


def _run(
    label: str, hits: list[int], lps: list[list[float | None]], toks: list[list[int]]
) -> QualityRun:
    return QualityRun(label=label, hits=hits, logprobs=lps, tokens=toks)


def test_scores_only_positions_every_run_computed() -> None:
    n = None
    exact = _run(
        "exact",
        [4, 4],
        [[n, n, n, n, n, -1.0, -2.0, -3.0], [n, n, n, n, n, -1.0, -1.0]],
        [[1, 2, 3, 4], [5, 6, 7, 8]],
    )
    # the lossy run loaded one chunk less of prompt 0 (its positions 2-4 were computed
    # there but not in exact: not compared) and scored its position 7 worse
    lossy = _run(
        "int8",
        [2, 4],
        [[n, n, -9.0, -9.0, -9.0, -1.0, -2.0, -4.0], [n, n, n, n, n, -1.0, -1.0]],
        [[1, 2, 9, 9], [5, 6, 7, 8]],
    )
    rows = score_runs({"exact": exact, "int8": lossy}, prefix_tokens=4)
    assert [r["codec"] for r in rows] == ["exact", "int8"]
    e, q = rows
    assert e["scored_positions"] == q["scored_positions"] == 5  # prompt 0: 5,6,7; prompt 1: 5,6
    assert e["perplexity"] == pytest.approx(math.exp(8 / 5))
    assert q["perplexity"] == pytest.approx(math.exp(9 / 5))
    assert q["perplexity_change"] == pytest.approx(math.exp(1 / 5) - 1)
    lo, hi = q["perplexity_change_ci95"]
    assert 0 <= lo <= q["perplexity_change"] <= hi
    assert e["greedy_agreement"] == 1.0 and e["perplexity_change"] == 0.0
    assert q["greedy_agreement"] == pytest.approx((2 / 4 + 1) / 2)
    assert q["greedy_identical_prompts"] == 0.5
    assert (q["hit_tokens_min"], q["prompts_with_full_prefix"]) == (2, 1)
    table = format_quality(rows, 4, {"int8": (0.04, 0.005)})
    assert "| `int8` | 3 (2) |" in table and "| 0.04 | 0.005 |" in table
    assert "| `exact` | 4 (4) |" in table and "+0.00%" in table


def test_a_prompt_that_loaded_nothing_refuses_the_run() -> None:
    exact = _run("exact", [4, 4], [[None] * 5 + [-1.0]] * 2, [[1], [1]])
    cold = _run("cachegen", [4, 0], [[None] * 5 + [-1.0]] * 2, [[1], [1]])
    with pytest.raises(RuntimeError, match=r"cachegen: 1 of 2 prompts loaded nothing"):
        score_runs({"exact": exact, "cachegen": cold}, prefix_tokens=4)


def test_nothing_scored_is_an_error() -> None:
    exact = _run("exact", [4], [[None] * 5], [[1]])
    with pytest.raises(RuntimeError, match="no prompt position"):
        score_runs({"exact": exact}, prefix_tokens=4)
