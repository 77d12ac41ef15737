"""What the connector of an in-process engine still has to do (benchmarks and tools).

For engines run with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and one rank, where the
worker shares the caller's process: how many chunks it has not finished storing, and a
wait until it has.
"""

from __future__ import annotations

import time

__all__ = ["saves_pending", "wait_for_saves"]


def saves_pending() -> int:
    """Chunks this process's connector still has to store (gathered but not yet in the
    first tier, or queued or running for a tier below); 0 without a connector."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return 0
    worker = getattr(get_kv_transfer_group(), "_worker", None)
    if worker is None or worker.saves is None or worker.storage is None:
        return 0
    return int(worker.saves.pending) + int(worker.storage.stats()["pending_stores"])


def wait_for_saves(timeout_s: float = 60.0, poll_s: float = 0.005) -> float:
    """Wait until every save reached every tier (at most ``timeout_s``); seconds waited."""
    t0 = time.perf_counter()
    while saves_pending() and time.perf_counter() - t0 < timeout_s:
        time.sleep(poll_s)
    return time.perf_counter() - t0
