"""Loads before the forward pass, copied layer by layer beside it.

A hit in the worker's memory tier is copied into vLLM's blocks by a helper thread, layer
after layer, while the engine thread goes on preparing and running the forward pass;
vLLM calls ``wait_for_layer_load(layer)`` before each attention layer reads its KV, and
that waits only for the layer's own copies. On this 2-core machine the forward pass of a
hit (one computed token) leaves a core idle most of the time, so most of the copy is
hidden.

Every copy here is one ``memmove`` of a contiguous run of blocks of one layer (the
stored chunk is ``[layers, blocks, ...]``, a layer's cache ``[blocks, ...]``), which
releases the GIL. A chunk that does not have the cache's layout is not planned here (the
caller copies such loads itself, before the forward pass).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading
import time
from collections.abc import Callable, Sequence

import torch

from .layout import block_runs

__all__ = ["LayerCopies", "Segment"]


#: ``(destination address, source address, bytes)`` of one contiguous copy
Segment = tuple[int, int, int]

_memmove = ctypes.memmove


class LayerCopies:
    """One batch of copies at a time, per layer, in one helper thread.

    ``layers`` are the per-layer caches ``[blocks, ...]`` (each contiguous, see
    :meth:`usable`), in the order of ``layer_names``."""

    def __init__(self, layer_names: Sequence[str], layers: Sequence[torch.Tensor]) -> None:
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.num_layers = len(layer_names)
        first = layers[0]
        self.num_blocks = int(first.shape[0])
        self.dtype = first.dtype
        self.block_shape = tuple(first.shape[1:])
        self.block_bytes = first[0].numel() * first.element_size()
        self._bases = [t.data_ptr() for t in layers]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="lmcache-layers"
        )
        self._done: list[threading.Event] = []
        self._future: concurrent.futures.Future[None] | None = None
        self.copy_seconds = 0.0  # in the helper thread
        self.wait_seconds = 0.0  # the engine thread waiting for a layer

    @staticmethod
    def usable(layers: Sequence[torch.Tensor]) -> bool:
        """Whether every layer's cache is one contiguous CPU tensor of the same shape."""
        return bool(layers) and all(
            t.device.type == "cpu"
            and t.is_contiguous()
            and t.shape == layers[0].shape
            and t.dtype == layers[0].dtype
            for t in layers
        )

    def plan(
        self,
        per_layer: list[list[Segment]],
        chunk: torch.Tensor,
        first: int,
        block_ids: Sequence[int],
    ) -> bool:
        """Add the copies of ``chunk[:, first + j]`` into block ``block_ids[j]`` of every
        layer to ``per_layer`` (``chunk``: a stored ``[layers, blocks, ...]`` chunk), one
        per run of consecutive blocks. ``False`` (nothing added) when ``chunk`` is not
        contiguous or not of this cache's layout, or a block is out of range."""
        if (
            chunk.dtype != self.dtype
            or chunk.dim() < 2
            or chunk.shape[0] != self.num_layers
            or tuple(chunk.shape[2:]) != self.block_shape
            or not chunk.is_contiguous()
            or chunk.device.type != "cpu"
            or first < 0
            or first + len(block_ids) > chunk.shape[1]
        ):
            return False
        bb = self.block_bytes
        per_chunk_layer = int(chunk.shape[1]) * bb
        base = chunk.data_ptr()
        runs = []
        for j, b, k in block_runs(block_ids):
            if b < 0 or b + k > self.num_blocks:
                return False
            runs.append((first + j, b, k))
        for layer, dst0 in enumerate(self._bases):
            src0 = base + layer * per_chunk_layer
            segs = per_layer[layer]
            for i, b, k in runs:
                segs.append((dst0 + b * bb, src0 + i * bb, k * bb))
        return True

    def start(self, per_layer: list[list[Segment]], after: Callable[[], None]) -> None:
        """Copy ``per_layer[l]`` for each layer ``l`` in order, then call ``after()`` (in
        the helper thread; e.g. to end the borrows the sources come from)."""
        self.wait_all()
        self._done = [threading.Event() for _ in per_layer]
        done = self._done

        def run() -> None:
            t0 = time.perf_counter()
            try:
                for layer, segments in enumerate(per_layer):
                    for d, s, n in segments:
                        _memmove(d, s, n)
                    done[layer].set()
            finally:
                for ev in done:  # (never leave a waiter hanging)
                    ev.set()
                self.copy_seconds += time.perf_counter() - t0
                after()

        self._future = self._pool.submit(run)

    def wait_layer(self, layer_name: str) -> None:
        """Wait until the running batch's copies into ``layer_name`` are done."""
        i = self.index.get(layer_name)
        done = self._done
        if i is None or i >= len(done) or done[i].is_set():
            return
        t0 = time.perf_counter()
        done[i].wait()
        self.wait_seconds += time.perf_counter() - t0

    def wait_all(self) -> None:
        """Wait until the running batch (if any) is done."""
        fut, self._future = self._future, None
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()
            self.wait_seconds += time.perf_counter() - t0

    def close(self) -> None:
        self.wait_all()
        self._pool.shutdown(wait=True)
