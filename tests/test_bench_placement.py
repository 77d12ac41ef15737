"""``bench_placement.py --hierarchy --cost-policy-file``: another version of the cost
policy loaded by path and measured beside the installed one, in one process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_placement.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(BENCH), "--hierarchy", "--chunks", "3000", "--rounds", "1"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_a_cost_policy_file_runs_beside_the_installed_policy_with_its_own_arms(
    tmp_path: Path,
) -> None:
    # copies of this tree's cost_aware.py: one as it is (the same decisions as the
    # installed policy), one admitting nothing (so the file, not the installed module,
    # is what runs under its name)
    src = (ROOT / "lmcache_core" / "placement" / "cost_aware.py").read_text()
    head = "    def admit(self, key: Hashable, info: ChunkInfo) -> bool:\n"
    assert head in src
    same, none = tmp_path / "same.py", tmp_path / "none.py"
    same.write_text(src)
    none.write_text(src.replace(head, head + "        return False\n"))
    res = _run(
        "--policies", "cost,costsame,costnone",
        "--cost-policy-file", f"costsame={same}",
        "--cost-policy-file", f"costnone={none}",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"policy costsame: CostAwarePolicy from {same}" in res.stdout
    digests = dict(re.findall(r"^(\w+): .* decisions sha256 (\w+)$", res.stdout, re.M))
    assert set(digests) == {"cost", "costsame", "costnone"}
    assert digests["cost"] == digests["costsame"] != digests["costnone"]
    assert re.search(r"^costnone: 0 admitted, [1-9]\d* refused", res.stdout, re.M)
    for arm in ("x-cost", "replay-cost-A", "x-costsame", "replay-costsame-B"):
        assert re.search(rf"^  {arm} +us/chunk per round: [\d.]+$", res.stdout, re.M), arm
    assert re.search(r"^costsame +[\d.]+ +[\d.]+ ", res.stdout, re.M)


def test_a_cost_policy_file_needs_an_alphanumeric_name() -> None:
    res = _run("--policies", "cost", "--cost-policy-file", "cost-ref=/nonexistent.py")
    assert res.returncode != 0
    assert "NAME=PATH with an alphanumeric NAME: cost-ref=/nonexistent.py" in res.stderr
