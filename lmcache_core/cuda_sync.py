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

__all__ = [
    "bind_thread",
    "blocking_event",
    "device_copy",
    "host_copy",
    "ready_event",
    "settle_caller",
    "wait_ready",
]

_bound = threading.local()


def bind_thread(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (once per thread; no-op
    for other devices)."""
    if device.type != "cuda" or getattr(_bound, "device", None) == device:
        return
    torch.cuda.set_device(device)
    _bound.device = device


def blocking_event() -> Any:
    """A CUDA event whose ``synchronize`` blocks the waiting thread instead of spinning."""
    return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]


def ready_event(*tensors: torch.Tensor) -> Any:
    """An event recorded on the calling thread's current stream of the first CUDA tensor
    among ``tensors`` (``None`` when there is none): once it completes, the work queued so
    far that writes or reads those tensors is done."""
    for t in tensors:
        if t.device.type == "cuda":
            ev = blocking_event()
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


def host_copy(event: Any, value: torch.Tensor) -> torch.Tensor:
    """A host copy of the device tensor ``value``, made after ``event`` (from a worker
    thread: the copy waits for the device)."""
    wait_ready(event, value.device)
    return value.detach().to("cpu")


def device_copy(event: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` after ``event`` (one side is a device tensor; from a worker
    thread). Complete when it returns: a blocking copy between host and device waits for
    its stream."""
    wait_ready(event, dst.device if dst.device.type == "cuda" else src.device)
    dst.copy_(src)


def settle_caller(*tensors: torch.Tensor) -> None:
    """In a blocking call that hands CUDA tensors to another thread (the IO loop's): wait,
    in the calling thread, for the work its current stream has queued on them, since an
    event recorded on the other thread would cover that thread's stream only."""
    event = ready_event(*tensors)
    if event is not None:
        event.synchronize()
