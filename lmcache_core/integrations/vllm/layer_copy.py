"""Loads before the forward pass, copied layer by layer beside it.

A hit in the worker's memory tier is copied into vLLM's blocks by a helper thread, layer
after layer, while the engine thread goes on preparing and running the forward pass;
vLLM calls ``wait_for_layer_load(layer)`` before each attention layer reads its KV, and
that waits only for the layer's own copies. On this 2-core machine the forward pass of a
hit (one computed token) leaves a core idle most of the time, so most of the copy is
hidden.

Every copy here is one ``memmove`` of a contiguous run of blocks of one layer (the
stored chunk is ``[layers, blocks, ...]``, a layer's cache ``[blocks, ...]``), which
releases the GIL. A run that is not contiguous on both sides is not planned here (the
caller copies such loads itself, before the forward pass).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["LayerCopies", "Segment"]

#: ``(destination address, source address, bytes)`` of one contiguous copy
Segment = tuple[int, int, int]

_memmove = ctypes.memmove


class LayerCopies:
    """One batch of copies at a time, per layer, in one helper thread."""

    def __init__(self, layer_names: Sequence[str]) -> None:
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.num_layers = len(layer_names)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="lmcache-layers"
        )
        self._done: list[threading.Event] = []
        self._future: concurrent.futures.Future[None] | None = None
        self.copy_seconds = 0.0  # in the helper thread
        self.wait_seconds = 0.0  # the engine thread waiting for a layer

    @staticmethod
    def segment(dst: torch.Tensor, src: torch.Tensor) -> Segment | None:
        """The copy of ``src`` into ``dst`` as one segment, or ``None`` when either is not
        contiguous or they differ in shape or dtype."""
        if (
            dst.shape != src.shape
            or dst.dtype != src.dtype
            or not (dst.is_contiguous() and src.is_contiguous())
            or dst.device.type != "cpu"
            or src.device.type != "cpu"
        ):
            return None
        return dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size()

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
