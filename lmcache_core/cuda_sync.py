"""Ordering host-side work after device work, for tiers and copies that take CUDA tensors.

A CUDA tensor handed to a tier may still be being written by kernels queued on the
caller's stream (any stream: vLLM computes on one of its own), and a buffer handed in to
be filled may still be read by queued work. The tier does its I/O later, on a worker
thread whose current stream is another one, so it records an event on the caller's
current stream when the call is made (:func:`ready_event`) and waits for it on the worker
before touching the memory (:func:`wait_ready`).

Worker threads start with device 0 current: any CUDA call there (an event's
``synchronize``, a device guard) would create a context on GPU 0 for a process that
works on another GPU (~0.5 GiB of GPU 0's memory each). :func:`bind_thread` makes the
tensor's device current on the calling thread first, once per thread. Everything here
is a no-op for CPU tensors and without CUDA.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["bind_thread", "ready_event", "wait_ready"]

_bound = threading.local()


def bind_thread(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (once per thread; no-op
    for other devices)."""
    if device.type != "cuda" or getattr(_bound, "device", None) == device:
        return
    torch.cuda.set_device(device)
    _bound.device = device


def ready_event(*tensors: torch.Tensor) -> Any:
    """An event recorded on the calling thread's current stream of the first CUDA tensor
    among ``tensors`` (``None`` when there is none): once it completes, the work queued so
    far that writes or reads those tensors is done."""
    for t in tensors:
        if t.device.type == "cuda":
            ev = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            ev.record(torch.cuda.current_stream(t.device))
            return ev
    return None


def wait_ready(event: Any, device: torch.device) -> None:
    """On a worker thread: wait for :func:`ready_event`'s ``event`` (``None``: nothing
    to wait for), bound to ``device`` first."""
    if event is None:
        return
    bind_thread(device)
    event.synchronize()
