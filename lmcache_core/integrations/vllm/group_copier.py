"""Whole-block copies of a chunk over several KV-cache groups (vLLM's hybrid KV-cache
manager on, e.g. Gemma-2's sliding-window and full-attention layers).

Under HMA every group has its own block table over one shared block pool (the groups'
layers alias the same memory, block ids are global). A stored chunk holds the layers of
every group, group after group in :attr:`~.layout.LayoutInfo.groups` order:
``[sum of layers, blocks_per_chunk, *block_shape]``; rows ``rows[g]`` belong to group
``g``, whose blocks for the chunk are given separately (``block_ids`` for the first
group, ``others[g - 1]`` for the rest).

A sliding-window group keeps real blocks only inside its window: vLLM gives it the null
block (id 0) for tokens outside it. A load leaves those positions alone (the model never
reads them); a gather of a chunk with a null block raises, the scheduler never plans one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .layout import BlockCopier, UnsupportedModel

__all__ = ["NULL_BLOCK", "GroupedCopier"]

#: vLLM's null block (``BlockPool.null_block``): a placeholder holding no token's KV.
NULL_BLOCK = 0


class GroupedCopier:
    """The :class:`~.layout.BlockCopier` interface over several groups' copiers (one per
    KV-cache group, in the stored chunk's row order)."""

    def __init__(self, copiers: Sequence[BlockCopier]) -> None:
        if len(copiers) < 2:
            raise ValueError("a grouped copier needs two groups or more")
        first = copiers[0]
        for c in copiers[1:]:
            if c.block_shape != first.block_shape or c.dtype != first.dtype:
                raise UnsupportedModel(
                    f"KV-cache groups with different block shapes or dtypes: "
                    f"{first.block_shape} {first.dtype} vs {c.block_shape} {c.dtype}"
                )
        self.copiers = list(copiers)
        self.num_layers = sum(c.num_layers for c in copiers)
        self.num_blocks = first.num_blocks
        self.block_shape = first.block_shape
        self.dtype = first.dtype
        self.device = first.device
        if self.device.type == "cuda":
            # one side stream each way: the last event covers every group
            stream, scatters = first._side_stream(), first._scatter_side_stream()
            for c in copiers[1:]:
                c._stream, c._scatter_stream = stream, scatters
        self.rows: list[tuple[int, int]] = []
        row = 0
        for c in copiers:
            self.rows.append((row, row + c.num_layers))
            row += c.num_layers

    @property
    def one_view(self) -> bool:
        """Whether each group's blocks move with one copy (per group)."""
        return all(c.one_view for c in self.copiers)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block position over every group's layers."""
        return sum(c.block_nbytes for c in self.copiers)

    def chunk_shape(self, blocks_per_chunk: int) -> tuple[int, ...]:
        """Shape of a stored chunk of ``blocks_per_chunk`` blocks."""
        return (self.num_layers, blocks_per_chunk, *self.block_shape)

    def _groups(self, block_ids: Sequence[int], others: Sequence[Sequence[int]]) -> list[list[int]]:
        ids = [list(block_ids), *(list(o) for o in others)]
        if len(ids) != len(self.copiers) or any(len(g) != len(ids[0]) for g in ids):
            raise ValueError(
                f"block ids for {len(ids)} groups of lengths {[len(g) for g in ids]}; "
                f"expected {len(self.copiers)} groups of {len(ids[0])}"
            )
        return ids

    # ------------------------------------------------------------------ gathers
    def gather(
        self, block_ids: Sequence[int], out: torch.Tensor, others: Sequence[Sequence[int]] = ()
    ) -> None:
        """Copy each group's blocks into its rows of ``out[:, :n]``."""
        for copier, (a, b), ids in zip(
            self.copiers, self.rows, self._checked_for_gather(block_ids, others), strict=True
        ):
            copier.gather(ids, out[a:b])

    def gather_to_host(
        self, block_ids: Sequence[int], out: torch.Tensor, others: Sequence[Sequence[int]] = ()
    ) -> Any:
        """:meth:`gather` into a host buffer; an event on CUDA (the last group's copy,
        queued after the others on the same side stream), ``None`` when done."""
        event = None
        for copier, (a, b), ids in zip(
            self.copiers, self.rows, self._checked_for_gather(block_ids, others), strict=True
        ):
            event = copier.gather_to_host(ids, out[a:b])
        return event

    def _checked_for_gather(
        self, block_ids: Sequence[int], others: Sequence[Sequence[int]]
    ) -> list[list[int]]:
        ids = self._groups(block_ids, others)
        for g, group in enumerate(ids):
            if NULL_BLOCK in group:
                raise ValueError(f"group {g} has no block for part of the chunk (null block)")
        return ids

    # ------------------------------------------------------------------ scatters
    def _present(
        self, src: torch.Tensor, block_ids: Sequence[int], others: Sequence[Sequence[int]]
    ) -> list[tuple[BlockCopier, torch.Tensor, list[int]]]:
        """Per group: its rows of ``src`` at the positions that have a real block."""
        out = []
        n = len(block_ids)
        if n and (src.shape[0] != self.num_layers or src.shape[1] != n):
            raise ValueError(f"source shape {tuple(src.shape)} does not match {n} blocks")
        for copier, (a, b), ids in zip(
            self.copiers, self.rows, self._groups(block_ids, others), strict=True
        ):
            keep = [j for j, blk in enumerate(ids) if blk != NULL_BLOCK]
            if not keep:
                continue
            rows = src[a:b]
            if len(keep) < n:
                rows = rows[:, keep]
            out.append((copier, rows, [ids[j] for j in keep]))
        return out

    def scatter(
        self, src: torch.Tensor, block_ids: Sequence[int], others: Sequence[Sequence[int]] = ()
    ) -> None:
        """Copy each group's rows of ``src[:, j]`` into its block ``j`` (null blocks are
        skipped)."""
        for copier, rows, ids in self._present(src, block_ids, others):
            copier.scatter(rows, ids)

    def scatter_from_host(
        self, src: torch.Tensor, block_ids: Sequence[int], others: Sequence[Sequence[int]] = ()
    ) -> Any:
        """:meth:`scatter` from a host buffer; returns the last group's event on CUDA
        (``None``: done). Use :meth:`order_before_compute` with it."""
        event = None
        for copier, rows, ids in self._present(src, block_ids, others):
            event = copier.scatter_from_host(rows, ids)
        return event

    def begin_step(self) -> None:
        """:meth:`.layout.BlockCopier.begin_step` of every group (no-op on CPU)."""
        for c in self.copiers:
            c.begin_step()

    def order_before_compute(self, events: Sequence[Any]) -> None:
        """Make the compute stream wait for side-stream copies (no-op on CPU)."""
        self.copiers[0].order_before_compute(events)
