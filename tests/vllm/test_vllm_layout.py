"""Layouts: synthetic KV caches built with vLLM's own view functions, bit-exact
gather -> store -> load -> scatter round trips, and the models the connector refuses."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import requires_vllm

from lmcache_core import CacheEngineKey, CPUBackend

pytestmark = [requires_vllm, pytest.mark.vllm]

NUM_BLOCKS, LAYERS, BLOCK = 12, 3, 16


def _spec(dtype: torch.dtype = torch.float32, **kw: Any) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=dtype, **kw)


def _caches(
    layout_name: str, dtype: torch.dtype, *, fill: bool, kernel_block: int | None = None
) -> tuple[torch.Tensor, list[torch.Tensor], Any]:
    """A raw byte buffer and one logical [B, H, N, C] view per layer, made by vLLM."""
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = _spec(dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, LAYERS, layout)
    size = LAYERS * NUM_BLOCKS * spec.page_size_bytes
    tensor = KVCacheTensor(
        size=size,
        layers=[f"l{i}" for i in range(LAYERS)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    gen = torch.Generator().manual_seed(7)
    raw = (
        torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        if fill
        else torch.zeros(size, dtype=torch.uint8)
    )
    raw = raw.view(torch.int8)
    views = create_kv_cache_views(
        raw, spec, NUM_BLOCKS, layout, tensor, kernel_block_size=kernel_block
    )
    return raw, views, spec


def _block_bytes(view: torch.Tensor, b: int, ratio: int = 1) -> bytes:
    grouped = view.view(NUM_BLOCKS, -1, *view.shape[1:]) if ratio > 1 else view
    return grouped[b].contiguous().view(torch.uint8).numpy().tobytes()


LAYOUTS = ["LBHNC", "LBNHC", "BLHNC", "BLNHC", "LHBNC", "BHLNC"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(layout: str, dtype: torch.dtype) -> None:
    from lmcache_core.integrations.vllm.layout import BlockCopier

    _, src_views, _ = _caches(layout, dtype, fill=True)
    dst_raw, dst_views, _ = _caches(layout, dtype, fill=False)
    src, dst = BlockCopier(src_views, NUM_BLOCKS), BlockCopier(dst_views, NUM_BLOCKS)
    assert src.chunk_shape(4) == (LAYERS, 4, 2, BLOCK, 64)
    src_ids, dst_ids = [3, 7, 1, 9], [0, 5, 2, 11]
    chunk = torch.empty(src.chunk_shape(4), dtype=dtype)
    src.gather(src_ids, chunk)

    async def store_and_load() -> torch.Tensor:
        async with CPUBackend({"max_bytes": "1MiB"}) as backend:
            key = CacheEngineKey("m", 1, 0, 42, str(dtype))
            assert await backend.put(key, chunk)
            chunk.zero_()  # the backend copied it
            out = torch.empty_like(chunk)
            assert await backend.get_into(key, out)
            return out

    loaded = asyncio.run(store_and_load())
    dst.scatter(loaded, dst_ids)
    for layer in range(LAYERS):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert _block_bytes(dst_views[layer], d) == _block_bytes(src_views[layer], s)
        untouched = set(range(NUM_BLOCKS)) - set(dst_ids)
        for b in untouched:
            assert not any(_block_bytes(dst_views[layer], b))
    # Nothing outside the scattered blocks was written.
    assert int(dst_raw.view(torch.uint8).count_nonzero()) <= len(dst_ids) * dst.block_nbytes


def test_partial_scatter_skips_leading_blocks() -> None:
    from lmcache_core.integrations.vllm.layout import BlockCopier

    _, src_views, _ = _caches("LBHNC", torch.float32, fill=True)
    _, dst_views, _ = _caches("LBHNC", torch.float32, fill=False)
    src, dst = BlockCopier(src_views, NUM_BLOCKS), BlockCopier(dst_views, NUM_BLOCKS)
    chunk = torch.empty(src.chunk_shape(4), dtype=torch.float32)
    src.gather([4, 5, 6, 7], chunk)
    dst.scatter(chunk[:, 2:4], [10, 11])  # blocks 0-1 of the chunk are computed locally
    assert _block_bytes(dst_views[0], 10) == _block_bytes(src_views[0], 6)
    assert _block_bytes(dst_views[2], 11) == _block_bytes(src_views[2], 7)
    assert not any(_block_bytes(dst_views[0], 4))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_scatters_copy_every_block_once_per_run_and_layer(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where every layer's blocks lie one after the other (vLLM's CPU layout, LBHNC), a
    host scatter is one ``memmove`` per run of consecutive blocks and layer, from a whole
    chunk or a slice of one; elsewhere torch copies. Either way every block's exact bytes
    land in its place and nothing else is written; a source of another dtype never takes
    the raw path."""
    from lmcache_core.integrations.vllm import layout as lay

    _, src_views, _ = _caches(layout, torch.float32, fill=True)
    chunk = torch.empty(lay.BlockCopier(src_views, NUM_BLOCKS).chunk_shape(6))
    lay.BlockCopier(src_views, NUM_BLOCKS).gather([6, 0, 1, 2, 9, 4], chunk)
    sizes: list[int] = []
    real = lay._memmove

    def counted(d: int, s: int, n: int) -> int:
        sizes.append(n)
        return int(real(d, s, n))

    monkeypatch.setattr(lay, "_memmove", counted)
    for ids, skip in (([2, 3, 4, 5], 0), ([9, 1, 7, 8, 0], 1), ([11], 5), ([3, 4], 4)):
        dst_raw, dst_views, _ = _caches(layout, torch.float32, fill=False)
        dst = lay.BlockCopier(dst_views, NUM_BLOCKS)
        sizes.clear()
        dst.scatter(chunk[:, skip : skip + len(ids)], ids)
        for layer in range(LAYERS):
            for j, b in enumerate(ids):
                want = chunk[layer, skip + j].contiguous().view(torch.uint8).numpy().tobytes()
                assert _block_bytes(dst_views[layer], b) == want, (ids, layer, j)
        nonzero = int(dst_raw.view(torch.uint8).count_nonzero())
        assert nonzero <= len(ids) * dst.block_nbytes
        runs = lay.block_runs(ids)
        if layout == "LBHNC":
            assert len(sizes) == LAYERS * len(runs)
            assert sum(sizes) == len(ids) * dst.block_nbytes
        else:  # (a layer's blocks are not one after the other in these layouts)
            assert sizes == []
    sizes.clear()
    dst.scatter(chunk[:, :2].to(torch.bfloat16), [0, 1])
    assert sizes == []


def test_kernel_blocks_are_regrouped_into_manager_blocks() -> None:
    from lmcache_core.integrations.vllm.layout import BlockCopier

    _, src_views, _ = _caches("LBHNC", torch.float32, fill=True, kernel_block=BLOCK // 2)
    _, dst_views, _ = _caches("LBHNC", torch.float32, fill=False, kernel_block=BLOCK // 2)
    assert src_views[0].shape[0] == 2 * NUM_BLOCKS
    src, dst = BlockCopier(src_views, NUM_BLOCKS), BlockCopier(dst_views, NUM_BLOCKS)
    chunk = torch.empty(src.chunk_shape(2), dtype=torch.float32)
    src.gather([1, 8], chunk)
    dst.scatter(chunk, [3, 4])
    assert _block_bytes(dst_views[1], 3, ratio=2) == _block_bytes(src_views[1], 1, ratio=2)
    assert _block_bytes(dst_views[1], 4, ratio=2) == _block_bytes(src_views[1], 8, ratio=2)


def test_cpu_layout_blocks_are_contiguous_pages() -> None:
    """On the CPU backend's layout (LBHNC) a block of a layer is one contiguous page, so
    copying whole blocks copies K (transposed) and V exactly as the kernel wrote them."""
    raw, views, spec = _caches("LBHNC", torch.float32, fill=True)
    page = spec.page_size_bytes
    for layer in (0, 2):
        for b in (0, 5):
            start = (layer * NUM_BLOCKS + b) * page
            assert (
                _block_bytes(views[layer], b)
                == raw.view(torch.uint8)[start : start + page].numpy().tobytes()
            )


def test_out_of_range_block_ids_raise() -> None:
    from lmcache_core.integrations.vllm.layout import BlockCopier

    _, views, _ = _caches("LBHNC", torch.float32, fill=False)
    copier = BlockCopier(views, NUM_BLOCKS)
    with pytest.raises(IndexError):
        copier.gather([NUM_BLOCKS], torch.empty(copier.chunk_shape(1)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gathers_put_every_blocks_bytes_in_place(layout: str) -> None:
    """``gather`` puts every block's exact bytes in its place, whatever the runs of block
    ids, also into a non-contiguous destination (the leading blocks of a larger chunk),
    and writes nothing past the chunk's blocks."""
    from lmcache_core.integrations.vllm.layout import BlockCopier

    _, views, _ = _caches(layout, torch.float32, fill=True)
    copier = BlockCopier(views, NUM_BLOCKS)
    for ids in ([2, 3, 4, 5], [3, 7, 1, 9], [8, 9, 0, 1], [11, 10, 6, 7]):
        for width in (4, 6):  # the chunk itself, and the leading blocks of a wider one
            out = torch.zeros(copier.chunk_shape(width))
            copier.gather(ids, out)
            assert not out[:, 4:].any()
            for layer in (0, LAYERS - 1):
                for j, b in enumerate(ids):
                    # (bytes, not values: random bytes hold NaNs)
                    got = out[layer, j].contiguous().view(torch.uint8).numpy().tobytes()
                    assert got == _block_bytes(views[layer], b), (ids, width, layer, j)


# ---------------------------------------------------------------------------- refusals
def _configs(
    spec: Any, *, groups: int = 1, layout: str = "LBHNC", device: str = "cpu", pp: int = 1
) -> tuple[Any, Any]:
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.attn"])
    kv_cache_config = SimpleNamespace(kv_cache_groups=[group] * groups, kv_cache_layout=layout)
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(kv_cache_layout=layout, cache_dtype="auto"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, decode_context_parallel_size=1),
        device_config=SimpleNamespace(device_type=device),
    )
    return vllm_config, kv_cache_config


def test_describe_full_attention() -> None:
    from lmcache_core.integrations.vllm.layout import describe_layout

    info = describe_layout(*_configs(_spec()))
    assert info.kv_layout == "vllm:cpu:LBHNC:h2:k32:v32"
    assert info.kv_dtype == "float32/auto"
    nhd = describe_layout(*_configs(_spec(), layout="NHD", device="cuda"))
    assert nhd.kv_layout == "vllm:cuda:LBNHC:h2:k32:v32"


def _mla() -> Any:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)


def _sliding() -> Any:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=128
    )


def _mamba() -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))


@pytest.mark.parametrize(
    ("make", "kw", "words"),
    [
        (_sliding, {}, "SlidingWindowSpec"),
        (_mamba, {}, "MambaSpec"),
        (_mamba, {"groups": 2}, "2 KV-cache groups"),
        (_spec, {"layout": "XYZ"}, "layout XYZ"),
        (_spec, {"device": "tpu"}, "device type"),
        (_spec, {"pp": 2}, "pipeline parallelism"),
        (lambda: _spec(num_head_slots=4), {}, "packed KV pages"),
    ],
)
def test_unsupported_models_are_refused(make: Any, kw: dict[str, Any], words: str) -> None:
    from lmcache_core.integrations.vllm.layout import UnsupportedModel, describe_layout

    with pytest.raises(UnsupportedModel, match=words):
        describe_layout(*_configs(make(), **kw))


@pytest.mark.parametrize(
    ("make", "groups", "words"),
    [
        (_sliding, 1, "SlidingWindowSpec"),
        (_mamba, 1, "MambaSpec"),
        (_mamba, 2, "2 KV-cache groups"),
        (_sliding, 2, "without full attention"),
    ],
)
def test_unrestorable_groups_mean_no_hits(make: Any, groups: int, words: str) -> None:
    """Models whose KV-cache groups the connector cannot all restore are an expected
    condition (no hits, INFO), distinguished from real errors."""
    from lmcache_core.integrations.vllm.layout import UnrestorableGroups, describe_layout

    with pytest.raises(UnrestorableGroups, match=words):
        describe_layout(*_configs(make(), groups=groups))


def _hma(*specs: Any) -> tuple[Any, Any]:
    vllm_config, kv_cache_config = _configs(_spec())
    kv_cache_config.kv_cache_groups = [
        SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}a", f"l{i}b"])
        for i, spec in enumerate(specs)
    ]
    return vllm_config, kv_cache_config


def test_hma_sliding_window_and_full_groups_are_restored_together() -> None:
    """HMA on (Gemma-2): the full-attention group's layers first, then the sliding-window
    group's; the namespace's layout names both, so chunks never mix with HMA off."""
    from lmcache_core.integrations.vllm.layout import UnrestorableGroups, describe_layout

    info = describe_layout(*_hma(_sliding(), _spec()))  # vLLM's group 0 is the window
    assert info.group_id == 1 and info.other_group_ids == (0,) and info.group_ids == (1, 0)
    assert info.layer_names == ("l1a", "l1b", "l0a", "l0b")
    assert [g.sliding_window for g in info.groups] == [None, 128]
    assert info.kv_layout == "vllm:cpu:LBHNC:h2:k32:v32:groups=fullx2+sw128x2"
    assert info.kv_layout != describe_layout(*_configs(_spec(sliding_window=128))).kv_layout
    with pytest.raises(UnrestorableGroups, match="MambaSpec"):
        describe_layout(*_hma(_spec(), _mamba()))


def test_hma_groups_of_other_block_shapes_are_refused() -> None:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from lmcache_core.integrations.vllm.layout import UnsupportedModel, describe_layout

    wide = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=4, head_size=32, dtype=torch.float32, sliding_window=64
    )
    with pytest.raises(UnsupportedModel, match="num_kv_heads"):
        describe_layout(*_hma(_spec(), wide))


def test_grouped_copier_round_trip_skips_null_blocks() -> None:
    """A chunk holds every group's layers; a sliding-window group's null blocks (outside
    its window) are neither written on load nor allowed in a save."""
    from lmcache_core.integrations.vllm.group_copier import NULL_BLOCK, GroupedCopier
    from lmcache_core.integrations.vllm.layout import BlockCopier

    full = [torch.randn(NUM_BLOCKS, 2, BLOCK, 8) for _ in range(2)]
    window = [torch.randn(NUM_BLOCKS, 2, BLOCK, 8) for _ in range(3)]
    copier = GroupedCopier([BlockCopier(full, NUM_BLOCKS), BlockCopier(window, NUM_BLOCKS)])
    assert copier.chunk_shape(2) == (5, 2, 2, BLOCK, 8)
    out = torch.empty(copier.chunk_shape(2))
    copier.gather([3, 4], out, [[7, 8]])
    assert torch.equal(out[1, 1], full[1][4]) and torch.equal(out[4, 0], window[2][7])
    with pytest.raises(ValueError, match="null block"):
        copier.gather([3, 4], out, [[NULL_BLOCK, 8]])
    before = window[0][NULL_BLOCK].clone()
    copier.scatter(out, [5, 6], [[NULL_BLOCK, 9]])
    assert torch.equal(full[0][5], full[0][3]) and torch.equal(full[1][6], full[1][4])
    assert torch.equal(window[2][9], window[2][8])
    assert torch.equal(window[0][NULL_BLOCK], before)  # the null block is left alone
    with pytest.raises(ValueError, match="groups"):
        copier.scatter(out, [5, 6])  # the window group's blocks are missing


def test_sliding_window_and_mla_single_groups_are_accepted() -> None:
    """HMA off: a sliding-window model's one full-attention group keeps every token's KV;
    MLA keeps one latent per token (no V, one head)."""
    from lmcache_core.integrations.vllm.layout import describe_layout

    sw = describe_layout(*_configs(_spec(sliding_window=64)))
    assert sw.kv_layout == "vllm:cpu:LBHNC:h2:k32:v32" and sw.group_id == 0
    mla = describe_layout(*_configs(_mla(), device="cuda"))
    assert mla.kv_layout == "vllm:cuda:LBHNC:h1:k576:v0"
    assert mla.num_kv_heads == 1 and mla.head_size_v == 0


def test_mla_on_cpu_gets_no_hits() -> None:
    """vLLM disables its own prefix caching for MLA on CPU; the connector follows."""
    from lmcache_core.integrations.vllm.layout import UnrestorableGroups, describe_layout

    with pytest.raises(UnrestorableGroups, match="MLA on CPU"):
        describe_layout(*_configs(_mla()))


def test_mla_cache_views_are_copied_whole() -> None:
    """MLA caches are 3-D ``[blocks, tokens, latent]``: gathered and scattered as one
    head."""
    from lmcache_core.integrations.vllm.layout import BlockCopier

    caches = [torch.randn(NUM_BLOCKS, BLOCK, 80) for _ in range(2)]
    copier = BlockCopier(caches, NUM_BLOCKS)
    out = torch.empty(copier.chunk_shape(2))
    copier.gather([3, 1], out)
    assert torch.equal(out[1, 0, 0], caches[1][3]) and torch.equal(out[0, 1, 0], caches[0][1])
    copier.scatter(out, [5, 6])
    assert torch.equal(caches[0][5], caches[0][3]) and torch.equal(caches[1][6], caches[1][1])


def test_unsupported_attention_backend_is_refused() -> None:
    from lmcache_core.integrations.vllm.layout import UnsupportedModel, check_attention_backends

    check_attention_backends("cpu", {"a": "CPU_ATTN"})
    check_attention_backends("cuda", {"a": "FLASH_ATTN", "b": "FLASHINFER"})
    with pytest.raises(UnsupportedModel, match="TRITON_ATTN"):
        check_attention_backends("cuda", {"a": "TRITON_ATTN"})
