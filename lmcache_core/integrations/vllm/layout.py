"""Which vLLM KV caches the connector can copy, and the whole-block copies themselves.

vLLM 0.32 hands every attention layer's cache to connectors as a 4-D *logical* view
``[B, H, N, C]`` (blocks, KV heads, tokens per block, K|V content) over one of the
physical layouts of :class:`vllm.v1.kv_cache_layout.KVCacheLayout` (``LBHNC`` = HND,
``LBNHC`` = NHD, and the cross-layer ``BL..`` variants). Inside a block the CPU backend
stores K transposed and then V, so the bytes of a block are only meaningful to the same
backend and layout: the connector copies **whole blocks**, in logical order, and records
the device type, layout and block shape in the namespace.

A stored chunk is one contiguous tensor ``[num_layers, blocks_per_chunk, *block_shape]``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...cuda_sync import bind_thread, blocking_event

__all__ = [
    "SUPPORTED_BACKENDS",
    "SUPPORTED_LAYOUTS",
    "BlockCopier",
    "GroupLayout",
    "LayoutInfo",
    "UnrestorableGroups",
    "UnsupportedModel",
    "check_attention_backends",
    "describe_layout",
]

#: Attention backends whose cache content the connector understands, per device type.
SUPPORTED_BACKENDS = {
    "cpu": frozenset({"CPU_ATTN", "CPU_MLA"}),
    "cuda": frozenset({"FLASH_ATTN", "FLASHINFER"}),
}
#: Physical layouts (``KVCacheLayout`` names) the copies are tested with.
SUPPORTED_LAYOUTS = frozenset({"LBHNC", "LBNHC", "BLHNC", "BLNHC", "LHBNC", "BHLNC"})
_QUANT_MODES_OK = frozenset({0, 1})  # KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR


class UnsupportedModel(Exception):
    """The model or cache layout is one the connector cannot serve (the message says why)."""


class UnrestorableGroups(UnsupportedModel):
    """The model has KV-cache groups the connector cannot restore (SSM state, MLA on
    CPU): the model runs normally and the connector reports no hits (an expected
    condition, logged at INFO)."""


#: KV-cache specs whose per-token KV the connector copies (MLA: one latent per token).
_RESTORABLE_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
#: Group kinds restored together under vLLM's hybrid KV-cache manager (HMA).
_HMA_SPECS = frozenset({"FullAttentionSpec", "SlidingWindowSpec"})


@dataclass(frozen=True)
class GroupLayout:
    """One KV-cache group the connector restores: vLLM's group id, its layers, and its
    sliding window (``None``: full attention)."""

    group_id: int
    layer_names: tuple[str, ...]
    sliding_window: int | None = None

    @property
    def tag(self) -> str:
        """The group's kind and size in the namespace (``full x2``, ``sw64 x2``)."""
        kind = "full" if self.sliding_window is None else f"sw{self.sliding_window}"
        return f"{kind}x{len(self.layer_names)}"


@dataclass(frozen=True)
class LayoutInfo:
    """What the namespace records about the KV cache, identical on every process."""

    device_type: str
    layout: str
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: str
    cache_dtype: str
    layer_names: tuple[str, ...]  # every copied layer, in the stored chunk's row order
    group_id: int = 0  # vLLM's id of the (first) full-attention group the connector copies
    num_groups: int = 1
    #: Under HMA with several groups: every group, the full-attention one first (its
    #: layers are the first rows of a stored chunk). Empty for one group.
    groups: tuple[GroupLayout, ...] = ()

    @property
    def group_ids(self) -> tuple[int, ...]:
        """vLLM's ids of the KV-cache groups a load restores."""
        return tuple(g.group_id for g in self.groups) or (self.group_id,)

    @property
    def other_group_ids(self) -> tuple[int, ...]:
        """The restored groups besides :attr:`group_id`, in row order."""
        return tuple(g.group_id for g in self.groups[1:])

    @property
    def kv_layout(self) -> str:
        """The namespace's ``kv_layout`` string (several groups: their kinds and sizes in
        row order, so chunks stored with HMA on and off never mix)."""
        base = (
            f"vllm:{self.device_type}:{self.layout}:h{self.num_kv_heads}"
            f":k{self.head_size}:v{self.head_size_v}"
        )
        if self.groups:
            base += ":groups=" + "+".join(g.tag for g in self.groups)
        return base

    @property
    def kv_dtype(self) -> str:
        """The namespace's ``kv_dtype`` string (storage dtype and vLLM's cache dtype)."""
        return f"{self.dtype}/{self.cache_dtype}"


def describe_layout(vllm_config: Any, kv_cache_config: Any) -> LayoutInfo:
    """Check the model's KV cache groups and return the layout description.

    Accepts one group of full-attention (a sliding window included: with vLLM's hybrid
    KV-cache manager off every token's KV is kept) or MLA layers, and, with HMA on,
    full-attention plus sliding-window groups of one block shape (:attr:`LayoutInfo.groups`).
    Raises :class:`UnrestorableGroups` for models with other KV-cache groups (SSM state)
    or whose only group is not attention KV, and
    :class:`UnsupportedModel` for chunked-local attention, packed/quantized caches and
    unknown layouts.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    hma: tuple[GroupLayout, ...] = ()
    first = 0
    if len(groups) != 1:
        # vLLM's hybrid KV-cache manager (HMA) is on: a hit must restore every group the
        # model reads at the hit position: full-attention and sliding-window KV are
        # restorable, SSM state is not.
        others = sorted({k for k in kinds if k not in _HMA_SPECS})
        if others or "FullAttentionSpec" not in kinds:
            raise UnrestorableGroups(
                f"the model has {len(groups)} KV-cache groups ({', '.join(kinds)}); the "
                "connector restores full-attention and sliding-window KV only, not "
                f"{', '.join(others) or 'a model without full attention'}, so it reports "
                "no hits and stores nothing for this model"
            )
        hma = _hma_groups(groups, kinds)
        first = hma[0].group_id
    spec = groups[first].kv_cache_spec
    kind = kinds[first]
    if kind not in _RESTORABLE_SPECS:
        raise UnrestorableGroups(
            f"the model's only KV-cache group is {kind} (not per-token attention KV); "
            "the connector reports no hits and stores nothing for this model"
        )
    # A sliding window on a full-attention spec (HMA off) is fine: vLLM then keeps the KV
    # of every token, which is what the connector stores and restores.
    if kind == "MLAAttentionSpec" and str(vllm_config.device_config.device_type) == "cpu":
        raise UnrestorableGroups(
            "vLLM turns its own prefix caching off for MLA on CPU, and a loaded prefix runs "
            "a prefill-with-context path it does not use there (measured: same tokens, but "
            "logprobs up to 0.016 apart from a full prefill in float32), so the connector "
            "reports no hits and stores nothing for this model"
        )
    if getattr(spec, "attention_chunk_size", None) is not None:
        raise UnsupportedModel("chunked local attention is not supported")
    for attr in ("page_size_padded", "num_head_slots", "state_content_bytes"):
        if getattr(spec, attr, None) is not None:
            raise UnsupportedModel(f"packed KV pages ({attr} is set) are not supported")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise UnsupportedModel("KV caches storing other than one state per token are not supported")
    quant = int(getattr(spec, "kv_quant_mode", 0))
    if quant not in _QUANT_MODES_OK:
        raise UnsupportedModel(f"KV cache quantization mode {quant} is not supported")
    if (
        getattr(spec, "dcp_sharded", False)
        and _parallel(vllm_config, "decode_context_parallel_size") > 1
    ):
        raise UnsupportedModel("decode context parallelism is not supported")
    if _parallel(vllm_config, "pipeline_parallel_size") > 1:
        raise UnsupportedModel("pipeline parallelism is not supported (tensor parallelism is)")
    cache_config = vllm_config.cache_config
    layout = kv_cache_config.kv_cache_layout or getattr(cache_config, "kv_cache_layout", None)
    if layout is None:
        raise UnsupportedModel("vLLM has not resolved the KV cache layout")
    layout = {"HND": "LBHNC", "NHD": "LBNHC"}.get(str(layout), str(layout))
    if layout not in SUPPORTED_LAYOUTS:
        raise UnsupportedModel(f"KV cache layout {layout} is not supported")
    device_type = str(vllm_config.device_config.device_type)
    if device_type not in SUPPORTED_BACKENDS:
        raise UnsupportedModel(f"device type {device_type!r} is not supported (cpu or cuda)")
    return LayoutInfo(
        device_type=device_type,
        layout=layout,
        block_size=int(spec.block_size),
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        head_size_v=int(spec.head_size_v),
        dtype=str(spec.dtype).removeprefix("torch."),
        cache_dtype=str(getattr(cache_config, "cache_dtype", "auto")),
        layer_names=tuple(n for g in hma for n in g.layer_names)
        if hma
        else tuple(groups[0].layer_names),
        group_id=first,
        num_groups=len(groups),
        groups=hma,
    )


def _hma_groups(groups: Sequence[Any], kinds: Sequence[str]) -> tuple[GroupLayout, ...]:
    """The groups of a full-attention + sliding-window model under HMA, the first
    full-attention group first; their blocks must have one shape."""
    first = kinds.index("FullAttentionSpec")
    base = groups[first].kv_cache_spec
    out = []
    for gid in [first, *(i for i in range(len(groups)) if i != first)]:
        spec = groups[gid].kv_cache_spec
        for attr in ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype"):
            if getattr(spec, attr, None) != getattr(base, attr, None):
                raise UnsupportedModel(
                    f"KV-cache groups {first} and {gid} differ in {attr} "
                    f"({getattr(base, attr, None)} vs {getattr(spec, attr, None)})"
                )
        window = (
            getattr(spec, "sliding_window", None) if kinds[gid] != "FullAttentionSpec" else None
        )
        out.append(GroupLayout(gid, tuple(groups[gid].layer_names), window))
    return tuple(out)


def _parallel(vllm_config: Any, name: str) -> int:
    return int(getattr(vllm_config.parallel_config, name, 1) or 1)


def check_attention_backends(device_type: str, backend_names: dict[str, str]) -> None:
    """Raise :class:`UnsupportedModel` unless every layer uses a supported backend."""
    allowed = SUPPORTED_BACKENDS.get(device_type, frozenset())
    bad = sorted({name for name in backend_names.values() if name not in allowed})
    if bad:
        raise UnsupportedModel(
            f"attention backend(s) {bad} on {device_type} are not supported "
            f"(supported: {sorted(allowed)})"
        )


class BlockCopier:
    """Gathers whole blocks of every layer into a chunk tensor and scatters them back.

    ``caches`` are the per-layer logical views in layer order; ``num_blocks`` is the
    manager's block count (a cache split into kernel blocks is regrouped so that one
    index is one manager block).

    vLLM 0.32 places every layer of a cache group in one backing allocation, layer ``l``
    at a constant ``layer_stride`` from layer ``l - 1`` (``vllm/v1/worker/utils.py``).
    When the views show that, one strided view ``[layers, blocks, *block]`` covers them
    all and a chunk is gathered or scattered with **one** indexed copy (:attr:`one_view`);
    otherwise with one copy per layer.

    On CUDA, :meth:`gather_to_host` and :meth:`scatter_from_host` run on a side stream
    ordered after the compute stream and return an event; the host buffers should be
    pinned (:func:`lmcache_core.memory.staging_empty`).
    """

    def __init__(self, caches: Sequence[torch.Tensor], num_blocks: int) -> None:
        if not caches:
            raise UnsupportedModel("no KV cache tensors were registered")
        views = [_group_blocks(c, num_blocks) for c in caches]
        first = views[0]
        for v in views[1:]:
            if v.shape != first.shape or v.dtype != first.dtype or v.device != first.device:
                raise UnsupportedModel(
                    f"layers have different KV cache shapes or dtypes: {tuple(first.shape)} "
                    f"{first.dtype} vs {tuple(v.shape)} {v.dtype}"
                )
        self.views = views
        self.num_layers = len(views)
        self.num_blocks = num_blocks
        self.block_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.device = first.device
        self._on_cpu = first.device.type == "cpu"
        self.combined = _combined_view(views)
        # Host scatters copy with one memmove per run and layer when every layer's blocks
        # lie one after the other (:meth:`_scatter_memmove`).
        self._memmove_scatters = (
            self._on_cpu and self.combined is not None and self.combined[0].is_contiguous()
        )
        # CUDA: gathers (saves) and scatters (loads) each on a side stream of their own, so
        # a wait for one never waits for the other; the last gather's event, which the
        # compute stream waits for at the next step; the compute stream's mark of this step,
        # which scatters wait for (:meth:`begin_step`).
        self._stream: Any = None
        self._scatter_stream: Any = None
        self._last_gather: Any = None
        self._compute_mark: Any = None
        n = self.num_layers * first_numel(self.block_shape)
        self._block_nbytes = n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def one_view(self) -> bool:
        """Whether one copy moves a chunk's blocks of every layer."""
        return self.combined is not None

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers."""
        return self._block_nbytes

    def chunk_shape(self, blocks_per_chunk: int) -> tuple[int, ...]:
        """Shape of a stored chunk of ``blocks_per_chunk`` blocks."""
        return (self.num_layers, blocks_per_chunk, *self.block_shape)

    def _check_range(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise IndexError(f"block ids {bad[:4]} out of range [0, {self.num_blocks})")

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        self._check_range(block_ids)
        if self._on_cpu:
            return torch.tensor(list(block_ids), dtype=torch.long)
        # From pinned memory, asynchronously: ``torch.tensor(..., device=cuda)`` copies from
        # pageable memory, which waits for the current stream (on a side stream that waits
        # for the compute stream: for the whole forward pass) with the engine thread held.
        host = torch.tensor(list(block_ids), dtype=torch.long, pin_memory=True)
        return host.to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ synchronous
    def gather(
        self, block_ids: Sequence[int], out: torch.Tensor, others: Sequence[Sequence[int]] = ()
    ) -> None:
        """Copy blocks ``block_ids`` of every layer into ``out[:, :len(block_ids)]``.
        (``others``: block ids of further KV-cache groups; a single-group copier takes
        none, see :class:`~.group_copier.GroupedCopier`.)"""
        _no_others(others)
        n = len(block_ids)
        if n == 0:
            return
        idx = self._index(block_ids)
        dst = out[:, :n]
        if self.combined is not None:
            # One indexed copy, single-threaded on CPU. One torch ``copy_`` per run of
            # consecutive blocks was 2x faster on two idle cores but, like every
            # two-thread ``copy_``, took 7-53 ms per 4 MiB chunk at the median (against
            # ~0.45 ms) in 3-6 of 11 cases with another process busy on each core
            # (benchmarks/bench_gather.py; docs/performance.md, "Save gathers").
            if self._on_cpu and dst.is_contiguous():
                torch.index_select(self.combined, 1, idx, out=dst)
            else:
                dst.copy_(self.combined.index_select(1, idx))
            return
        for layer, view in enumerate(self.views):
            d = out[layer, :n]
            if self._on_cpu and d.is_contiguous():
                torch.index_select(view, 0, idx, out=d)
            else:
                d.copy_(view.index_select(0, idx))

    def scatter(
        self, src: torch.Tensor, block_ids: Sequence[int], others: Sequence[Sequence[int]] = ()
    ) -> None:
        """Copy ``src[:, j]`` into block ``block_ids[j]`` of every layer."""
        _no_others(others)
        n = self._check_src(src, block_ids)
        if n == 0:
            return
        if not self._on_cpu:
            # complete when this returns (the caller may reuse ``src`` at once)
            src = src.to(self.device)
        self._scatter(src, block_ids)

    def _scatter(self, src: torch.Tensor, block_ids: Sequence[int]) -> None:
        combined = self.combined
        if combined is None:
            idx = self._index(block_ids)
            for layer, view in enumerate(self.views):
                view.index_copy_(0, idx, src[layer])
            return
        if self._memmove_scatters and self._memmove_source(src):
            self._scatter_memmove(src, block_ids)
            return
        # One copy per run of consecutive blocks, all layers at once (an indexed copy
        # into a strided view measured 2x slower than these on CPU).
        for j, b, k in block_runs(block_ids):
            combined[:, b : b + k].copy_(src[:, j : j + k])

    def _memmove_source(self, src: torch.Tensor) -> bool:
        """Whether ``src`` (``[layers, n, *block]``, checked by :meth:`_check_src`) holds
        each layer's blocks one after the other in host memory, in the cache's dtype."""
        return (
            src.device.type == "cpu"
            and src.dtype == self.dtype
            and tuple(src.shape[2:]) == self.block_shape
            and src[0].is_contiguous()
        )

    def _scatter_memmove(self, src: torch.Tensor, block_ids: Sequence[int]) -> None:
        """One single-threaded ``memmove`` per run of consecutive blocks and layer (block
        ids already range-checked). Not torch's ``copy_``: that one splits a copy across
        its OpenMP threads, and whenever another thread or process holds one of the cores
        (vLLM's forward pass beside an async load, other engines) it waits a scheduler
        time slice or more for the descheduled member: 7-25 ms instead of ~0.5 ms per
        4 MiB chunk at the median with 64- and 128-token blocks
        (``benchmarks/bench_gather.py --ops scatter``, loaded condition). The address
        arithmetic is :meth:`.layer_copy.LayerCopies.plan`'s, over one strided view."""
        combined = self.combined
        assert combined is not None
        esize = combined.element_size()
        block = first_numel(self.block_shape) * esize  # bytes of one block of one layer
        d_base, d_layer = combined.data_ptr(), combined.stride(0) * esize
        s_base, s_layer = src.data_ptr(), src.stride(0) * esize
        for j, b, k in block_runs(block_ids):
            n = k * block
            for layer in range(self.num_layers):
                _memmove(
                    d_base + layer * d_layer + b * block, s_base + layer * s_layer + j * block, n
                )

    def _check_src(self, src: torch.Tensor, block_ids: Sequence[int]) -> int:
        n = len(block_ids)
        if n and (src.shape[0] != self.num_layers or src.shape[1] != n):
            raise ValueError(f"source shape {tuple(src.shape)} does not match {n} blocks")
        return n

    # ------------------------------------------------------------------ device copies
    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        return self._stream

    def _scatter_side_stream(self) -> Any:
        if self._scatter_stream is None:
            self._scatter_stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        return self._scatter_stream

    def begin_step(self) -> None:
        """On the engine thread, once per step before its forward pass is queued (no-op on
        CPU): the compute stream waits for the gathers queued so far (their blocks may be
        freed and rewritten from this step on: a finished request's, a sliding window's),
        and this step's mark is recorded on it, after which this step's scatters run (they
        may come from helper threads, whose current stream is not vLLM's compute stream).
        Both waits are on the device; the engine thread does not block."""
        if self._on_cpu:
            return
        current = torch.cuda.current_stream(self.device)
        if self._last_gather is not None:
            current.wait_event(self._last_gather)
        mark = torch.cuda.Event()  # type: ignore[no-untyped-call]
        mark.record(current)
        self._compute_mark = mark

    def gather_to_host(
        self, block_ids: Sequence[int], out: torch.Tensor, others: Sequence[Sequence[int]] = ()
    ) -> Any:
        """:meth:`gather` into a host buffer; on CUDA it runs on a side stream after the
        work queued so far and returns an event to wait on before reading ``out``
        (``None``: the copy is done)."""
        _no_others(others)
        if self._on_cpu:
            self.gather(block_ids, out)
            return None
        n = len(block_ids)
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            idx = self._index(block_ids)
            if self.combined is not None:
                tmp = self.combined.index_select(1, idx)
            else:
                tmp = torch.stack([v.index_select(0, idx) for v in self.views])
            out[:, :n].copy_(tmp, non_blocking=True)
            event = blocking_event()
            event.record(stream)
        self._last_gather = event
        return event

    def scatter_from_host(
        self, src: torch.Tensor, block_ids: Sequence[int], others: Sequence[Sequence[int]] = ()
    ) -> Any:
        """:meth:`scatter` from a host buffer; on CUDA it runs on a side stream and
        returns an event (the compute stream must wait for it before reading the blocks,
        see :meth:`order_before_compute`); ``None``: the copy is done."""
        _no_others(others)
        if self._on_cpu:
            self.scatter(src, block_ids)
            return None
        n = self._check_src(src, block_ids)
        bind_thread(self.device)
        stream = self._scatter_side_stream()
        mark = self._compute_mark
        if mark is not None:
            stream.wait_event(mark)
        with torch.cuda.stream(stream):
            if n:
                self._scatter(_to_device(src, self.device), block_ids)
            event = blocking_event()
            event.record(stream)
        return event

    def order_before_compute(self, events: Sequence[Any]) -> None:
        """Make the compute stream wait for side-stream copies (no-op on CPU)."""
        if self._on_cpu:
            return
        current = torch.cuda.current_stream(self.device)
        for ev in events:
            if ev is not None:
                current.wait_event(ev)


_memmove = ctypes.memmove  # releases the GIL


def _to_device(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``src`` on ``device``, asynchronously from pinned memory. A host tensor that is not
    contiguous (part of a chunk: ``buf[:, skip:skip + n]``) goes layer by layer: torch
    would first copy it whole into pageable memory, on the calling thread, and then copy
    that synchronously."""
    if src.device.type != "cpu" or src.is_contiguous():
        return src.to(device, non_blocking=True)
    out = torch.empty(src.shape, dtype=src.dtype, device=device)
    for layer in range(src.shape[0]):
        out[layer].copy_(src[layer], non_blocking=True)
    return out


def _no_others(others: Sequence[Sequence[int]]) -> None:
    if others:
        raise ValueError("a single-group copier got block ids of other KV-cache groups")


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(source index, first block, length)`` of each run of consecutive block ids."""
    out: list[tuple[int, int, int]] = []
    for j, b in enumerate(block_ids):
        if out and out[-1][1] + out[-1][2] == b:
            s0, b0, k = out[-1]
            out[-1] = (s0, b0, k + 1)
        else:
            out.append((j, b, 1))
    return out


def _combined_view(views: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One ``[layers, blocks, *block]`` view over per-layer views placed at a constant
    stride in one allocation, or ``None``."""
    first = views[0]
    if len(views) == 1:
        return first.unsqueeze(0)
    try:
        storages = {v.untyped_storage().data_ptr() for v in views}
    except (RuntimeError, NotImplementedError):
        return None
    if len(storages) != 1 or any(v.stride() != first.stride() for v in views):
        return None
    esize = first.element_size()
    step = views[1].data_ptr() - first.data_ptr()
    if step <= 0 or step % esize:
        return None
    if any(v.data_ptr() - first.data_ptr() != i * step for i, v in enumerate(views)):
        return None
    combined = first.as_strided(
        (len(views), *first.shape),
        (step // esize, *first.stride()),
        first.storage_offset(),
    )
    # The strided view must address exactly the layers' bytes (no overlap between layers).
    for i in (0, len(views) - 1):
        if combined[i].data_ptr() != views[i].data_ptr():
            return None
    return combined


def first_numel(shape: Sequence[int]) -> int:
    """Number of elements of ``shape``."""
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _group_blocks(cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    if cache.dim() == 3:  # MLA: [B, N, C], one latent vector per token and no heads
        cache = cache.unsqueeze(1)
    if cache.dim() != 4:
        raise UnsupportedModel(
            f"KV cache view has shape {tuple(cache.shape)}; expected the 4-D [B, H, N, C] view"
        )
    if cache.shape[0] == num_blocks:
        return cache
    if num_blocks <= 0 or cache.shape[0] % num_blocks:
        raise UnsupportedModel(
            f"KV cache has {cache.shape[0]} blocks, not a multiple of the {num_blocks} manager blocks"
        )
    grouped: torch.Tensor = cache.view(num_blocks, -1, *cache.shape[1:])
    return grouped
