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
    before ``skip`` are already computed locally and are not touched). ``other_blocks``:
    the same positions in each other restored KV-cache group (HMA on; a null block, id 0,
    is a position outside a sliding window: not written).
    """

    req_id: str
    chunk_index: int
    chunk_hash: int
    skip: int
    block_ids: list[int]
    other_blocks: list[list[int]] = field(default_factory=list)


@dataclass
class ChunkSave:
    """Gather the blocks of one computed chunk and store it.

    ``reads`` are the blocks this chunk's computation read that were being loaded in a
    step whose outcome the scheduler did not know yet: the worker drops the save if any
    of them failed to load (the chunk was computed over wrong KV).
    """

    req_id: str
    chunk_index: int
    chunk_hash: int
    block_ids: list[int]
    reads: list[int] = field(default_factory=list)
    other_blocks: list[list[int]] = field(default_factory=list)  # as in ChunkLoad


@dataclass
class StepMetadata(KVConnectorMetadata):
    """One engine step's work for the workers.

    ``step`` numbers the steps; ``acked`` is the last step whose worker report the
    scheduler had processed when it built this one (failures up to it are accounted for
    in its planning). ``loads`` load before the forward pass (chunks in the workers'
    memory tier, loads of a request in chunk order); ``async_loads`` start background
    loads reported through ``get_finished``; ``failed_blocks`` are blocks of planned
    loads that could not be planned (reported as load errors); ``release`` lists, per
    rank, chunks the scheduler no longer offers (their pins end after this step's
    loads); ``finish_after_save`` names finished requests whose blocks vLLM keeps until
    the workers have gathered their saves; ``reset`` orders every worker to clear its
    private tiers before any load of the step; ``failed_async`` names requests whose
    background load could not be planned whole (several KV-cache groups: vLLM takes no
    block-level errors there, the workers report the request's load as failed).
    ``chains`` (only with a placement
    policy configured) holds, per request scheduled for the first time, the hashes of
    its prompt's full chunks in order: the workers tell their hierarchy's policies
    (``observe_prefix``), which would otherwise see neither the misses nor the chain.
    ``idle`` says the step computes nothing
    (vLLM steps back to back while a request waits for its KV: a worker with background
    loads running may then wait for them instead of returning at once).
    """

    step: int = 0
    acked: int = 0
    loads: list[ChunkLoad] = field(default_factory=list)
    async_loads: dict[str, list[ChunkLoad]] = field(default_factory=dict)
    saves: list[ChunkSave] = field(default_factory=list)
    failed_blocks: list[int] = field(default_factory=list)
    release: dict[int, list[int]] = field(default_factory=dict)
    finish_after_save: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    failed_async: list[str] = field(default_factory=list)
    #: ``reset_cache`` was called: clear the private tiers before this step's loads
    reset: bool = False
    chains: list[list[int]] = field(default_factory=list)
    #: the step schedules no tokens (nothing waits on the worker but its own loads)
    idle: bool = False

    def is_empty(self) -> bool:
        return not (
            self.reset
            or self.loads
            or self.async_loads
            or self.saves
            or self.failed_blocks
            or self.failed_async
            or self.release
            or self.finish_after_save
            or self.chains
        )


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """What the workers did, merged over ranks by :meth:`aggregate`.

    ``step``: the last step whose metadata the workers processed. ``stored``: rank ->
    hashes whose store into the top (memory) tier completed. ``evicted``: rank -> hashes
    that tier evicted. ``missing``: rank -> hashes promised for a load but absent (stale
    hits). ``withdrawn``: rank -> hashes the rank asks the scheduler to stop offering
    (policy ``fail``). ``failed_loads``: request id -> first chunk index that could not
    be loaded before the forward pass on some rank. ``async_failed``: request id ->
    chunk indices a background load could not load. ``dropped_saves``: request id ->
    first chunk index whose save was dropped (staging full, store refused).
    ``disabled``: rank -> reason, for a worker that turned itself off.
    """

    step: int = -1
    stored: dict[int, list[int]] = field(default_factory=dict)
    evicted: dict[int, list[int]] = field(default_factory=dict)
    missing: dict[int, list[int]] = field(default_factory=dict)
    withdrawn: dict[int, list[int]] = field(default_factory=dict)
    failed_loads: dict[str, int] = field(default_factory=dict)
    async_failed: dict[str, list[int]] = field(default_factory=dict)
    dropped_saves: dict[str, int] = field(default_factory=dict)
    disabled: dict[int, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, WorkerReport):
            return self
        out = WorkerReport(step=max(self.step, other.step), disabled=dict(self.disabled))
        for name in ("stored", "evicted", "missing", "withdrawn"):
            merged: dict[int, list[int]] = {k: list(v) for k, v in getattr(self, name).items()}
            for rank, hashes in getattr(other, name).items():
                merged.setdefault(rank, []).extend(hashes)
            setattr(out, name, merged)
        for name in ("failed_loads", "dropped_saves"):
            mins: dict[str, int] = dict(getattr(self, name))
            for req_id, idx in getattr(other, name).items():
                mins[req_id] = min(idx, mins.get(req_id, idx))
            setattr(out, name, mins)
        failed = {k: list(v) for k, v in self.async_failed.items()}
        for req_id, idxs in other.async_failed.items():
            failed[req_id] = sorted(set(failed.get(req_id, [])) | set(idxs))
        out.async_failed = failed
        out.disabled.update(other.disabled)
        return out

    def is_empty(self) -> bool:
        return self.step < 0 and not (
            self.stored
            or self.evicted
            or self.missing
            or self.withdrawn
            or self.failed_loads
            or self.async_failed
            or self.dropped_saves
            or self.disabled
        )
