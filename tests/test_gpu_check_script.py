"""``tools/gpu_check.sh`` rehearsed on this CPU machine.

The script runs on a GPU machine lent for a few minutes at most, so a mistake in the
script itself (a path, an import, a flag) would cost that whole run. Its rehearsal mode
(``GPU_CHECK_REHEARSAL=1``) runs every section here: the CUDA tests skip with their
reasons, everything else runs as it will there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ)
    full.pop("PYTHONPATH", None)
    full.update(
        PYTHON=sys.executable,
        GPU_SITE=str(tmp_path / "site"),
        GPU_CHECK_LOG=str(tmp_path / "out" / "gpu_check.log"),
        KVIKIO_WHEELS=str(tmp_path / "no-wheels"),
        **env,
    )
    return subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real thing")
def test_rehearsal_runs_every_section(tmp_path: Path) -> None:
    r = _run(tmp_path, GPU_CHECK_REHEARSAL="1")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    for section in ("== vLLM connector: block copies", "== gds backend:"):
        assert section in out
    assert "REHEARSAL: torch" in out
    # the project was installed --no-deps into the scratch folder and imported from there
    assert "lmcache_core from " + str(tmp_path / "site" / "lmcache_core") in out
    assert "gds I/O path here: POSIX O_DIRECT fallback" in out
    # each pytest run collected its tests and skipped the CUDA ones with a reason
    assert "needs an NVIDIA GPU" in out
    assert "needs CUDA: pinned host memory" in out
    # the throughput benchmark ran its steps on host tensors, bit-exact, with its A/A
    assert "gds I/O path: posix" in out and "on cpu" in out
    assert "bit-exact" in out and "(A/A " in out
    assert "gpu_check: all sections passed" in out
    # the log file holds the same output
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "gpu_check: all sections passed" in log


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real thing")
def test_without_rehearsal_it_refuses_a_machine_without_cuda(tmp_path: Path) -> None:
    r = _run(tmp_path)
    assert r.returncode != 0
    assert "torch sees no CUDA device here" in r.stdout + r.stderr
    assert "all sections passed" not in r.stdout + r.stderr


def test_wheel_fetcher_parses() -> None:
    r = subprocess.run(
        ["bash", "-n", str(ROOT / "tools" / "fetch_gpu_wheels.sh")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
