"""benchmarks/profile_save_path.py runs end to end on a small budget and accounts for the
save path it claims to profile: the disk tier's put phases are seen, once per chunk."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "profile_save_path.py"


def test_small_run_reports_threads_and_one_write_per_chunk(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *("--chunks", "3", "--batches", "2", "--repeats", "1", "--warm", "1"),
            *("--cpu-bytes", "64MiB", "--dir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "3 x 4 MiB chunks per batch" in out and "young tier" in out
    # every chunk stored was written once, checksummed once and renamed into place once
    for phase in ("objects._write", "checksum (xxh3_128)", "tier.rename"):
        m = re.search(rf"^  {re.escape(phase)}\s+([\d.]+)\s", out, re.M)
        assert m is not None, (phase, out)
        assert float(m.group(1)) == 3.0, (phase, out)
    assert re.search(r"^  MainThread\s+[\d.]+\s+\d+$", out, re.M), out
    assert "reservations on the calling thread" in out
    # the temporary tier is gone with the run
    assert list(tmp_path.iterdir()) == []
