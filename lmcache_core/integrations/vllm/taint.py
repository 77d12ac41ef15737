"""Which of vLLM's KV blocks may hold wrong data, so that no chunk computed over one is
ever stored (scheduler side).

vLLM shares blocks between requests: the blocks a request loads before the forward pass
enter vLLM's prefix cache at allocation, so a request admitted in the same step computes
on top of them; under asynchronous scheduling the next step is planned before this one's
outcome is known. A load that fails therefore leaves wrong KV not only in the loading
request's blocks but in everything computed over them, by any request.

:class:`BlockTaint` tracks, per block id:

* **suspect**: a load into the block is in flight or its outcome has not been reported;
* **poisoned**: the block is known to hold wrong data from slot ``clean`` on (a failed
  load, or written by a computation that read a poisoned block) until a computation that
  read only good data rewrites it.

Only requests *holding* such blocks are followed (their block table contains one: the
loading request, and requests admitted with a prefix-cache hit covering one). A block
that enters a table fresh cannot carry old data to its new owner, so it stops being
poisoned. For each step it records what those requests read and write; when a failure
is reported for an earlier step, the taint is propagated through the recorded steps and
the save progress of every holder of a newly poisoned block is reset (:attr:`resets`).

Saves are then planned only from clean blocks (:meth:`save_reads` answers ``None``
otherwise) and carry the suspect blocks they read, which the workers check against the
failures they saw but the scheduler has not yet heard of.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Access", "BlockTaint"]

_ASYNC = -1  # suspect step of a background load (resolved when the request's load ends)


@dataclass
class Access:
    """What one request read and wrote in one step (only requests holding tracked blocks).

    ``reads``: (tracked block, slots read); ``writes``: (table index, block, first slot,
    end slot)."""

    req_id: str
    reads: list[tuple[int, int]]
    writes: list[tuple[int, int, int, int]]


class BlockTaint:
    """Suspect and poisoned blocks, their holders, and recent accesses (see module doc)."""

    def __init__(self, block_size: int, blocks_per_chunk: int) -> None:
        self.bs = block_size
        self.bpc = blocks_per_chunk
        self.suspect: dict[int, tuple[int, str]] = {}  # block -> (step or _ASYNC, loader)
        self.poisoned: dict[int, int] = {}  # block -> clean leading slots
        self.held: dict[str, dict[int, int]] = {}  # request -> block -> index in its table
        self.holders: dict[int, set[str]] = {}
        self.resets: dict[str, int] = {}  # request -> first chunk whose save must be redone
        self._records: list[tuple[int, list[Access]]] = []

    # ------------------------------------------------------------------ membership
    def tracked(self, block: int) -> bool:
        return block in self.suspect or block in self.poisoned

    def holds(self, req_id: str) -> bool:
        """Whether the request's table holds a suspect or poisoned block."""
        return bool(self.held.get(req_id))

    def _hold(self, req_id: str, block: int, index: int) -> None:
        self.held.setdefault(req_id, {})[block] = index
        self.holders.setdefault(block, set()).add(req_id)

    def _forget_if_clean(self, block: int) -> None:
        if self.tracked(block):
            return
        for req_id in self.holders.pop(block, ()):
            table = self.held.get(req_id)
            if table is not None:
                table.pop(block, None)
                if not table:
                    del self.held[req_id]

    # ------------------------------------------------------------------ block tables
    def admit(self, req_id: str, block_ids: Sequence[int], shared_blocks: int) -> None:
        """A request's whole table at admission; ``block_ids[:shared_blocks]`` may be
        prefix-cache hits (shared contents), the rest is fresh."""
        self.drop(req_id)
        if not (self.suspect or self.poisoned):
            return
        for i, b in enumerate(block_ids):
            if not self.tracked(b):
                continue
            if i < shared_blocks or b in self.suspect:
                self._hold(req_id, b, i)
            else:
                self.poisoned.pop(b, None)
                self._forget_if_clean(b)

    def fresh(self, block_ids: Iterable[int]) -> None:
        """Blocks newly allocated to a running request: their old contents are gone."""
        if not self.poisoned:
            return
        for b in block_ids:
            if b in self.poisoned and b not in self.suspect:
                del self.poisoned[b]
                self._forget_if_clean(b)

    def loading(self, req_id: str, blocks: Iterable[tuple[int, int]], step: int | None) -> None:
        """Blocks ``(index, block)`` receive a load planned for ``step`` (``None``: a
        background load)."""
        mark = (_ASYNC if step is None else step, req_id)
        for idx, b in blocks:
            self.poisoned.pop(b, None)  # the load overwrites it whole
            self.suspect[b] = mark
            self._hold(req_id, b, idx)

    def drop(self, req_id: str) -> None:
        """The request no longer holds its blocks (finished, preempted, re-admitted)."""
        for b in self.held.pop(req_id, {}):
            users = self.holders.get(b)
            if users is not None:
                users.discard(req_id)
                if not users:
                    del self.holders[b]
        self.resets.pop(req_id, None)

    # ------------------------------------------------------------------ computation
    def _tainted(self, reads: Iterable[tuple[int, int]]) -> bool:
        p = self.poisoned
        return any(b in p and p[b] < n for b, n in reads)

    def _write(self, req_id: str, write: tuple[int, int, int, int], clean: bool) -> bool:
        """Apply one write; ``True`` when it newly poisoned slots."""
        idx, b, a, e = write
        if clean:
            c = self.poisoned.get(b)
            if c is not None and a <= c:
                c = max(c, e)
                if c >= self.bs:
                    del self.poisoned[b]
                    self._forget_if_clean(b)
                else:
                    self.poisoned[b] = c
            return False
        before = self.poisoned.get(b, self.bs)
        self.poisoned[b] = min(before, a)
        self._hold(req_id, b, idx)
        return self.poisoned[b] < before

    def access(
        self, req_id: str, block_ids: Sequence[int], computed: int, scheduled: int
    ) -> Access:
        """The reads and writes of a holding request computing ``scheduled`` tokens after
        ``computed`` ones, over its table ``block_ids``."""
        bs = self.bs
        table = self.held.get(req_id, {})
        reads = [(b, min(bs, computed - i * bs)) for b, i in table.items() if i * bs < computed]
        writes = []
        end = computed + scheduled
        for i in range(computed // bs, min(len(block_ids), -(-end // bs))):
            a = max(0, computed - i * bs)
            e = min(bs, end - i * bs)
            writes.append((i, block_ids[i], a, e))
        return Access(req_id, reads, writes)

    def record_step(self, step: int, accesses: list[Access]) -> None:
        """Apply one step's computation: writes of requests reading only good data clean
        what they rewrite (in the same forward pass, each layer writes before it reads, so
        another request reading a block rewritten here reads it clean); writes of the
        others are poisoned. The accesses are kept for later failure reports."""
        if not accesses:
            return
        pending = list(accesses)
        progress = True
        while progress and pending:
            progress = False
            for acc in list(pending):
                if not self._tainted(acc.reads):
                    for w in acc.writes:
                        self._write(acc.req_id, w, clean=True)
                    pending.remove(acc)
                    progress = True
        for acc in pending:
            for w in acc.writes:
                self._write(acc.req_id, w, clean=False)
        self._records.append((step, accesses))

    # ------------------------------------------------------------------ saves
    def save_reads(self, req_id: str, end_block: int) -> list[int] | None:
        """For a save of the chunk ending at table index ``end_block`` of a request: the
        suspect blocks its computation read, or ``None`` when it read a poisoned one."""
        table = self.held.get(req_id)
        if not table:
            return []
        reads = []
        for b, i in table.items():
            if i >= end_block:
                continue
            if b in self.poisoned:
                return None
            reads.append(b)
        return reads

    # ------------------------------------------------------------------ outcomes
    def resolve_step(self, step: int, failed: Iterable[int]) -> set[int]:
        """The workers' report of ``step`` arrived: its loads (and those of earlier steps)
        are done, ``failed`` did not load. Returns the newly poisoned blocks."""
        bad = set(failed)
        for b, (s, _) in list(self.suspect.items()):
            if s != _ASYNC and s <= step:
                del self.suspect[b]
                if b not in bad:
                    self._forget_if_clean(b)
        new = self._fail(bad, step)
        self._records = [(s, accs) for s, accs in self._records if s > step]
        return new

    def resolve_async(self, req_id: str, failed: Iterable[int]) -> set[int]:
        """A background load of ``req_id`` ended; ``failed`` are its blocks that did not load."""
        bad = set(failed)
        for b, (s, r) in list(self.suspect.items()):
            if s == _ASYNC and r == req_id:
                del self.suspect[b]
                if b not in bad:
                    self._forget_if_clean(b)
        return self._fail(bad, None)

    def _fail(self, bad: set[int], from_step: int | None) -> set[int]:
        new: set[int] = set()
        for b in bad:
            self.suspect.pop(b, None)
            if self.poisoned.get(b, self.bs) > 0:
                new.add(b)
            self.poisoned[b] = 0
        if not new:
            return new
        for s, accs in self._records:
            if from_step is not None and s < from_step:
                continue
            for acc in accs:
                if self._tainted(acc.reads):
                    for w in acc.writes:
                        if self._write(acc.req_id, w, clean=False):
                            new.add(w[1])
        for b in new:
            for req_id in self.holders.get(b, ()):
                chunk = self.held[req_id][b] // self.bpc
                self.resets[req_id] = min(chunk, self.resets.get(req_id, chunk))
        return new

    def take_resets(self) -> dict[str, int]:
        out, self.resets = self.resets, {}
        return out

    def stats(self) -> dict[str, int]:
        return {
            "suspect_blocks": len(self.suspect),
            "poisoned_blocks": len(self.poisoned),
            "holding_requests": len(self.held),
        }
