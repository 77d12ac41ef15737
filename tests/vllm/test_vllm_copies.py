"""Block copies on synthetic caches (no vLLM needed): CPU always, CUDA when present.

``tools/gpu_check.sh`` runs this file on a machine with an NVIDIA GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from copy_checks import CHECKS

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__)
def test_copies(check: Callable[[str], None], device: str) -> None:
    check(device)
