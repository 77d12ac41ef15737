"""The connector's block copies on synthetic KV caches, on any torch device; no vLLM.

Caches are laid out as vLLM 0.32 lays them (one backing allocation, every layer at a
constant stride: layer-major ``LBHNC`` and block-major ``BLHNC``), built here with plain
``torch.as_strided``. Used by ``test_vllm_copies.py`` and, on a machine with an NVIDIA
GPU (``tools/gpu_check.sh``), runnable without pytest: ``python tests/vllm/copy_checks.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

LAYERS, BLOCKS, HEADS, TOKENS, CONTENT = 3, 16, 2, 16, 64


def caches(device: str, layout: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, C]`` views over one zeroed allocation."""
    page = HEADS * TOKENS * CONTENT
    raw = torch.zeros(LAYERS * BLOCKS * page, dtype=dtype, device=device)
    if layout == "LBHNC":
        layer_stride, block_stride = BLOCKS * page, page
    elif layout == "BLHNC":
        layer_stride, block_stride = page, LAYERS * page
    else:
        raise ValueError(layout)
    return [
        raw.as_strided(
            (BLOCKS, HEADS, TOKENS, CONTENT),
            (block_stride, TOKENS * CONTENT, CONTENT, 1),
            layer * layer_stride,
        )
        for layer in range(LAYERS)
    ]


def fill(views: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=gen).to(v.device, v.dtype))


def check_one_copy_round_trip(device: str) -> None:
    """Gather to (pinned, on CUDA) host staging and scatter back: bit-exact, one strided
    view for all layers, nothing outside the target blocks written."""
    from lmcache_core.integrations.vllm.layout import BlockCopier
    from lmcache_core.memory import staging_empty

    for layout in ("LBHNC", "BLHNC"):
        src_views, dst_views = caches(device, layout), caches(device, layout)
        fill(src_views, 1)
        src, dst = BlockCopier(src_views, BLOCKS), BlockCopier(dst_views, BLOCKS)
        assert src.one_view and dst.one_view, layout
        out = staging_empty(src.chunk_shape(4), torch.float32)
        assert out.is_pinned() == torch.cuda.is_available()
        ev = src.gather_to_host([3, 4, 9, 1], out)
        if ev is not None:
            ev.synchronize()
        for j, b in enumerate([3, 4, 9, 1]):
            for layer in range(LAYERS):
                assert torch.equal(out[layer, j].to(device), src_views[layer][b])
        ev = dst.scatter_from_host(out[:, 1:], [7, 8, 2])
        dst.order_before_compute([ev])
        for layer in range(LAYERS):
            assert torch.equal(dst_views[layer][7], src_views[layer][4])
            assert torch.equal(dst_views[layer][8], src_views[layer][9])
            assert torch.equal(dst_views[layer][2], src_views[layer][1])
            untouched = [b for b in range(BLOCKS) if b not in (7, 8, 2)]
            assert not dst_views[layer][untouched].any()


def check_separate_allocations_copy_per_layer(device: str) -> None:
    from lmcache_core.integrations.vllm.layout import BlockCopier

    views = [caches(device, "LBHNC")[0].clone() for _ in range(LAYERS)]
    fill(views, 2)
    cp = BlockCopier(views, BLOCKS)
    assert not cp.one_view
    out = torch.empty(cp.chunk_shape(2))
    cp.gather([5, 6], out)
    assert torch.equal(out[2, 1].to(device), views[2][6])


def check_side_stream_copies_are_ordered(device: str) -> None:
    """On CUDA: a gather sees what the compute stream wrote just before (no explicit
    synchronisation by the caller), and compute queued after ``order_before_compute``
    sees what a scatter wrote."""
    if not device.startswith("cuda"):
        return
    from lmcache_core.integrations.vllm.layout import BlockCopier
    from lmcache_core.memory import staging_empty

    views = caches(device, "LBHNC")
    cp = BlockCopier(views, BLOCKS)
    big = torch.randn(4096, 4096, device=device)
    for _ in range(3):
        big = big @ big.T / 4096  # keep the compute stream busy
        views[0][5].fill_(7.0)  # queued after the matmuls
    out = staging_empty(cp.chunk_shape(1), torch.float32)
    cp.gather_to_host([5], out).synchronize()
    assert bool((out[0, 0] == 7.0).all())
    out.fill_(3.0)
    ev = cp.scatter_from_host(out, [9])
    cp.order_before_compute([ev])
    total = views[1][9].sum()  # compute-stream work after the wait
    assert float(total) == 3.0 * HEADS * TOKENS * CONTENT


CHECKS: list[Callable[[str], None]] = [
    check_one_copy_round_trip,
    check_separate_allocations_copy_per_layer,
    check_side_stream_copies_are_ordered,
]


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for check in CHECKS:
        check(device)
        print(f"ok  {check.__name__} ({device})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
