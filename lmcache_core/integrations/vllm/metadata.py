"""What the scheduler-side connector tells the workers each step, and what they answer.

Both travel through vLLM's own channels (in-process, or pickled to worker processes), so
they hold only plain values: chunk hashes as ints, block ids, request ids. Workers build
their own keys from the hashes with their rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["ChunkLoad", "ChunkSave", "StepMetadata", "WorkerReport"]


@dataclass
class ChunkLoad:
    """Load one stored chunk and write blocks ``skip..`` of it into ``block_ids``.

    ``block_ids`` are the request's blocks for the chunk from block ``skip`` on (blocks
    before ``skip`` are already computed locally and are not touched).
    """

    req_id: str
    chunk_index: int
    chunk_hash: int
    skip: int
    block_ids: list[int]


@dataclass
class ChunkSave:
    """Gather the blocks of one newly computed chunk and store it."""

    req_id: str
    chunk_index: int
    chunk_hash: int
    block_ids: list[int]


@dataclass
class StepMetadata(KVConnectorMetadata):
    """One engine step's loads and saves (loads of a request are in chunk order)."""

    loads: list[ChunkLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.loads and not self.saves


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """What the workers did this step, merged over ranks by :meth:`aggregate`.

    ``stored``: rank -> hashes now stored by that rank. ``missing``: rank -> hashes that
    failed to load there (no longer assumed stored). ``failed_loads``: request id -> the
    first chunk index that could not be loaded on some rank (those requests saved
    nothing this step). ``disabled``: rank -> reason, for a worker that turned itself off.
    """

    stored: dict[int, list[int]] = field(default_factory=dict)
    missing: dict[int, list[int]] = field(default_factory=dict)
    failed_loads: dict[str, int] = field(default_factory=dict)
    disabled: dict[int, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, WorkerReport):
            return self
        out = WorkerReport(
            stored={k: list(v) for k, v in self.stored.items()},
            missing={k: list(v) for k, v in self.missing.items()},
            failed_loads=dict(self.failed_loads),
            disabled=dict(self.disabled),
        )
        for rank, hashes in other.stored.items():
            out.stored.setdefault(rank, []).extend(hashes)
        for rank, hashes in other.missing.items():
            out.missing.setdefault(rank, []).extend(hashes)
        for req_id, idx in other.failed_loads.items():
            out.failed_loads[req_id] = min(idx, out.failed_loads.get(req_id, idx))
        out.disabled.update(other.disabled)
        return out

    def is_empty(self) -> bool:
        return not (self.stored or self.missing or self.failed_loads or self.disabled)
