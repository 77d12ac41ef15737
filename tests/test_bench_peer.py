"""The logic of benchmarks/bench_peer.py that needs no LMCache: ratios and their summary,
the page-cache control (fadvise + mincore) and the raw O_DIRECT baseline."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_peer as bp  # noqa: E402


def test_figures_ratios_and_spreads() -> None:
    s = {"ours A": [1.0, 1.0, 3.0], "ours B": [1.1, 1.1], "LMCache": [2.0, 4.0, 2.0, 4.0, 2.0]}
    ours = bp.figure(s, "ours", work=10.0)
    assert ours["time"] == 1.1 and ours["rate"] == pytest.approx(10 / 1.1)
    assert ours["aa"] == pytest.approx(1.1)  # A's median 1.0, B's 1.1
    theirs = bp.figure(s, "LMCache", work=10.0)
    assert theirs["time"] == 2.0
    assert theirs["aa"] == pytest.approx(2.0)  # even reps 2,2,2 vs odd reps 4,4
    row = bp.make_row("r", "GB/s", ours, {"LMCache": theirs, "raw": None})
    assert row["ratios"]["LMCache"] == pytest.approx(2.0 / 1.1)  # their time / ours
    assert row["ratios"]["raw"] is None
    assert row["aa"] == pytest.approx(2.0)


def test_summary_takes_the_median_of_runs_and_keeps_each() -> None:
    def run(ratio: float, rate: float) -> dict[str, object]:
        ours = {"time": 1.0, "rate": rate, "aa": 1.01}
        other = {"time": ratio, "rate": rate / ratio, "aa": 1.05}
        return {"rows": [bp.make_row("put", "GB/s", ours, {"LMCache": other})]}

    summary = bp.summarize([run(1.2, 2.0), run(0.9, 3.0), run(1.5, 2.5)])
    (row,) = summary
    assert row["ratios"]["LMCache"]["runs"] == pytest.approx([1.2, 0.9, 1.5])
    assert row["ratios"]["LMCache"]["median"] == pytest.approx(1.2)
    assert row["ours"] == 2.5 and row["aa"] == pytest.approx(1.05)
    table = bp.render(summary)
    assert "| put | 2.50 GB/s |" in table and "1.20 / 0.90 / 1.50 (**1.20x**)" in table
    rejected = bp.make_row("token DB, numpy", "Mtok/s", {"time": 1, "rate": 3, "aa": 1},
                           {"LMCache": None})  # fmt: skip
    assert "rejected" in bp.render(bp.summarize([{"rows": [rejected]}]))
    assert math.isnan(bp.halves_spread([1.0]))


def test_make_cold_empties_the_page_cache_of_the_files(tmp_path: Path) -> None:
    paths = []
    for i in range(3):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(256 * 1024))
        paths.append(str(p))
        assert p.read_bytes()  # read: in the page cache now
    assert all(bp.resident_pages(p) > 0 for p in paths)
    bp.make_cold(paths)
    assert all(bp.resident_pages(p) == 0 for p in paths)
    (tmp_path / "empty").write_bytes(b"")
    assert bp.resident_pages(str(tmp_path / "empty")) == 0


def test_raw_baseline_writes_and_reads_the_same_bytes(tmp_path: Path) -> None:
    nbytes = 1 << 20
    src = [bp.aligned_bytes(nbytes) for _ in range(5)]
    for i, b in enumerate(src):
        b[:] = bytes([i + 1]) * nbytes
    try:
        paths = bp.raw_write(str(tmp_path / "raw"), [f"c{i}" for i in range(5)], src, qd=4)
    except OSError as exc:  # pragma: no cover - a filesystem without O_DIRECT
        pytest.skip(f"O_DIRECT refused here: {exc}")
    dst = [bp.aligned_bytes(nbytes) for _ in range(5)]
    bp.make_cold(paths)
    bp.raw_read(paths, dst, qd=4, request=256 * 1024)  # 4 requests per file
    assert [bytes(d[:4]) for d in dst] == [bytes([i + 1]) * 4 for i in range(5)]
    assert all(bytes(d) == bytes(s) for d, s in zip(dst, src, strict=True))


def test_without_lmcache_it_says_how_to_get_it() -> None:
    try:
        import lmcache  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover - running inside .venv-peer
        pytest.skip("LMCache is installed in this environment")
    res = subprocess.run([sys.executable, str(BENCH / "bench_peer.py"), "--runs", "1"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode != 0
    assert "make bench-peer" in res.stderr


def test_the_raw_baseline_publishes_like_a_tier_and_lists_cold_files(tmp_path: Path) -> None:
    """``publish``: written under temporary names, renamed into place, no temporary left;
    ``files_under`` finds exactly the files of at least the given size."""
    import _storage

    src = [_storage.aligned_bytes(8192) for _ in range(3)]
    for i, b in enumerate(src):
        b[:] = bytes([i + 7]) * 8192
    try:
        paths = _storage.raw_write(str(tmp_path / "raw"), ["a", "b", "c"], src, qd=2,
                                   request=4096, publish=True)  # fmt: skip
    except OSError as exc:  # pragma: no cover - a filesystem without O_DIRECT
        pytest.skip(f"O_DIRECT refused here: {exc}")
    assert sorted(os.listdir(tmp_path / "raw")) == ["a", "b", "c"]
    (tmp_path / "raw" / "small").write_bytes(b"x")
    assert sorted(_storage.files_under(str(tmp_path), 8192)) == sorted(paths)
    assert [Path(p).read_bytes() for p in paths] == [bytes(b) for b in src]
