"""The connector's block copies on synthetic KV caches, on any torch device; no vLLM.

Caches are laid out as vLLM 0.32 lays them (one backing allocation, every layer at a
constant stride: layer-major ``LBHNC`` and block-major ``BLHNC``), built here with plain
``torch.as_strided``. Used by ``test_vllm_copies.py`` and, on a machine with an NVIDIA
GPU (``tools/gpu_check.sh``), runnable without pytest: ``python tests/vllm/copy_checks.py``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

LAYERS, BLOCKS, HEADS, TOKENS, CONTENT = 3, 16, 2, 16, 64


def caches(
    device: str, layout: str, dtype: torch.dtype = torch.float32, content: int = CONTENT
) -> list[torch.Tensor]:
    """Per-layer ``[B, H, N, C]`` views over one zeroed allocation."""
    page = HEADS * TOKENS * content
    raw = torch.zeros(LAYERS * BLOCKS * page, dtype=dtype, device=device)
    if layout == "LBHNC":
        layer_stride, block_stride = BLOCKS * page, page
    elif layout == "BLHNC":
        layer_stride, block_stride = page, LAYERS * page
    else:
        raise ValueError(layout)
    return [
        raw.as_strided(
            (BLOCKS, HEADS, TOKENS, content),
            (block_stride, TOKENS * content, content, 1),
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


def _busy(device: str, n: int) -> None:
    """Queue ``n`` large matrix products on the current (compute) stream."""
    a = torch.randn(8192, 8192, device=device)
    for _ in range(n):
        a = a @ a.T / 8192


def check_gathers_do_not_wait_for_the_compute_stream(device: str) -> None:
    """On CUDA: ``gather_to_host`` queues its copy behind the compute stream and returns
    while that is still busy (the engine thread never waits for the forward pass: the
    block-id index goes to the device from pinned memory, asynchronously)."""
    if not device.startswith("cuda"):
        return
    from lmcache_core.integrations.vllm.layout import BlockCopier
    from lmcache_core.memory import staging_empty

    views = caches(device, "LBHNC")
    cp = BlockCopier(views, BLOCKS)
    out = staging_empty(cp.chunk_shape(2), torch.float32)
    torch.cuda.synchronize()
    _busy(device, 12)
    t0 = time.perf_counter()
    ev = cp.gather_to_host([1, 2], out)
    queued = time.perf_counter() - t0
    pending = not ev.query()
    ev.synchronize()
    assert pending, f"the gather was complete when its call returned ({queued * 1e3:.1f} ms)"
    assert torch.equal(out[0, 1].to(device), views[0][2])


def check_next_step_compute_waits_for_gathers(device: str) -> None:
    """On CUDA: blocks gathered in one step and rewritten by the next step's compute (a
    finished request's blocks reused) are stored as they were when gathered:
    ``begin_step`` makes the compute stream wait for the gathers queued before it."""
    if not device.startswith("cuda"):
        return
    from lmcache_core.integrations.vllm.layout import BlockCopier
    from lmcache_core.memory import staging_empty

    views = caches(device, "LBHNC", content=32768)  # 4 MiB per block and layer
    for v in views:
        v.uniform_()
    cp = BlockCopier(views, BLOCKS)
    ids = list(range(8))  # 96 MiB to copy to the host: far longer than the fill below
    want = [v[0:8].clone() for v in views]
    out = staging_empty(cp.chunk_shape(8), torch.float32)
    torch.cuda.synchronize()
    ev = cp.gather_to_host(ids, out)
    cp.begin_step()
    for v in views:
        v[0:8].fill_(-1.0)  # the next step writes into the same blocks
    ev.synchronize()
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert torch.equal(out[layer].to(device), want[layer]), f"layer {layer} was overwritten"


def check_helper_thread_scatters_follow_the_step_compute(device: str) -> None:
    """On CUDA: a scatter from a helper thread (async loads) runs after the compute queued
    before the step began (``begin_step``'s mark), though that thread's current stream is
    not the compute stream; the thread is bound to the cache's device."""
    if not device.startswith("cuda"):
        return
    from lmcache_core.integrations.vllm.layout import BlockCopier
    from lmcache_core.memory import staging_empty

    views = caches(device, "LBHNC")
    cp = BlockCopier(views, BLOCKS)
    src = staging_empty(cp.chunk_shape(1), torch.float32)
    src.fill_(5.0)
    torch.cuda.synchronize()
    _busy(device, 6)
    for v in views:
        v[9].fill_(-1.0)  # the compute stream's last write to the block, queued before the step
    cp.begin_step()
    seen: dict[str, object] = {}

    def helper() -> None:
        try:
            cp.scatter_from_host(src, [9]).synchronize()
            seen["device"] = torch.cuda.current_device()
        except BaseException as exc:  # reported below
            seen["error"] = exc

    t = threading.Thread(target=helper)
    t.start()
    t.join()
    assert "error" not in seen, seen
    assert seen["device"] == (cp.device.index or 0)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        assert bool((views[layer][9] == 5.0).all()), f"layer {layer}: the scatter ran first"


CHECKS: list[Callable[[str], None]] = [
    check_one_copy_round_trip,
    check_separate_allocations_copy_per_layer,
    check_side_stream_copies_are_ordered,
    check_gathers_do_not_wait_for_the_compute_stream,
    check_next_step_compute_waits_for_gathers,
    check_helper_thread_scatters_follow_the_step_compute,
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
